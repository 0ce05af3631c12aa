// jaxsample's own binding of FlashInfer's header-only sampling kernels (the
// headers come from a local source copy, never from this repository): shared
// checks of the torch tensors handed to the launchers.
#pragma once

#include <ATen/cuda/CUDAContext.h>
#include <torch/extension.h>

namespace jaxsample_flashinfer {

inline cudaStream_t current_stream() { return at::cuda::getCurrentCUDAStream(); }

inline void check_status(cudaError_t status, const char* launcher) {
  TORCH_CHECK(status == cudaSuccess, "FlashInfer's ", launcher, " failed: ",
              cudaGetErrorString(status));
}

// A contiguous CUDA tensor of `rank` dimensions and dtype `dtype`.
inline void check_tensor(const at::Tensor& x, const char* name, int64_t rank,
                         at::ScalarType dtype) {
  TORCH_CHECK(x.is_cuda() && x.is_contiguous() && x.dim() == rank && x.scalar_type() == dtype,
              name, " must be a contiguous ", rank, "-d ", c10::toString(dtype),
              " CUDA tensor, got ", x.scalar_type(), " of shape ", x.sizes());
}

// [batch, vocab] float32 rows and the [batch] int32 tokens (and bool valid flags) written.
inline void check_rows_and_outputs(const at::Tensor& rows, const at::Tensor& tokens,
                                   const at::Tensor* valid) {
  check_tensor(rows, "rows", 2, at::kFloat);
  check_tensor(tokens, "tokens", 1, at::kInt);
  TORCH_CHECK(tokens.size(0) == rows.size(0), "tokens must have one entry per row");
  if (valid != nullptr) {
    check_tensor(*valid, "valid", 1, at::kBool);
    TORCH_CHECK(valid->size(0) == rows.size(0), "valid must have one entry per row");
  }
}

// Launchers defined in topk.cu (a translation unit of its own: it compiles in parallel).
void radix_top_k(at::Tensor rows, at::Tensor indices, at::Tensor values, at::Tensor row_states,
                 bool sorted, bool deterministic);

}  // namespace jaxsample_flashinfer
