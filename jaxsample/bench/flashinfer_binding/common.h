// jaxsample's own binding of FlashInfer's header-only sampling kernels (the headers come
// from a local source copy, never from this repository): the launchers' declarations and
// the checks of the torch tensors handed to them.  Each launcher is a translation unit of
// its own (launch_*.cu), so the build compiles them side by side; binding.cpp exports them.
// Every launcher runs on torch's current stream (so CUDA graphs capture it) with FlashInfer's
// Python defaults: deterministic kernels, no row indices, scalar parameters, and the Philox
// `seed` and `offset` that its Python API takes from torch's generator.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace jaxsample_flashinfer {

constexpr bool kDeterministic = true;  // FlashInfer's Python default

inline cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream(); }

inline void check_status(cudaError_t status, const char* launcher) {
  TORCH_CHECK(status == cudaSuccess, "FlashInfer's ", launcher, " failed: ",
              cudaGetErrorString(status));
}

// A contiguous CUDA tensor of `rank` dimensions and dtype `dtype`.
inline void check_tensor(const at::Tensor& x, const char* name, int64_t rank,
                         at::ScalarType dtype) {
  TORCH_CHECK(x.is_cuda() && x.is_contiguous() && x.dim() == rank && x.scalar_type() == dtype,
              name, " must be a contiguous ", rank, "-d ", c10::toString(dtype),
              " CUDA tensor, got ", c10::toString(x.scalar_type()), " of shape ", x.sizes());
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

// OnlineSoftmax: probs = softmax(logits / temperature); `workspace`: FlashInfer's 1 MiB
// uint8 buffer of the split-vocabulary path; `enable_pdl`: programmatic dependent launch.
void softmax(at::Tensor logits, at::Tensor probs, at::Tensor workspace, double temperature,
             bool enable_pdl);
// SamplingFromLogits: one token per row of the logits.
void sampling_from_logits(at::Tensor logits, at::Tensor tokens, uint64_t seed, uint64_t offset);
// TopKSamplingFromProb, TopPSamplingFromProb, MinPSamplingFromProb and
// TopKTopPSamplingFromProb (both filters at once: FlashInfer's "joint" order).
void top_k_sampling_from_probs(at::Tensor probs, at::Tensor tokens, at::Tensor valid,
                               int64_t top_k, uint64_t seed, uint64_t offset);
void top_p_sampling_from_probs(at::Tensor probs, at::Tensor tokens, at::Tensor valid,
                               double top_p, uint64_t seed, uint64_t offset);
void min_p_sampling_from_probs(at::Tensor probs, at::Tensor tokens, at::Tensor valid,
                               double min_p, uint64_t seed, uint64_t offset);
void top_k_top_p_sampling_from_probs(at::Tensor probs, at::Tensor tokens, at::Tensor valid,
                                     int64_t top_k, double top_p, uint64_t seed,
                                     uint64_t offset);
// TopKDispatch: the k largest entries of each float32 row, int32 `indices` [batch, k] and
// their `values`; `row_states`: FlashInfer's zeroed 1 MiB scratch of the multi-CTA path.
void radix_top_k(at::Tensor rows, at::Tensor indices, at::Tensor values, at::Tensor row_states,
                 bool sorted, bool deterministic);

}  // namespace jaxsample_flashinfer
