// A launcher of jaxsample's FlashInfer binding (common.h).
// sampling.cuh first: FlashInfer's topk.cuh uses names that sampling.cuh brings in.
#include <flashinfer/sampling.cuh>

#include "common.h"

namespace jaxsample_flashinfer {

namespace sampling = flashinfer::sampling;

void radix_top_k(at::Tensor rows, at::Tensor indices, at::Tensor values, at::Tensor row_states,
                 bool sorted, bool deterministic) {
  check_tensor(rows, "rows", 2, at::kFloat);
  check_tensor(indices, "indices", 2, at::kInt);
  check_tensor(values, "values", 2, at::kFloat);
  check_tensor(row_states, "row_states", 1, at::kByte);
  TORCH_CHECK(indices.sizes() == values.sizes() && indices.size(0) == rows.size(0),
              "indices and values must both be [batch, k]");
  check_status(sampling::TopKDispatch<float, int32_t>(
                   rows.data_ptr<float>(), indices.data_ptr<int32_t>(), values.data_ptr<float>(),
                   rows.size(0), indices.size(1), rows.size(1),
                   reinterpret_cast<sampling::RadixRowState*>(row_states.data_ptr()), sorted,
                   deterministic, sampling::TopKTieBreak::None, current_stream(),
                   /*dsa_graph_safe=*/false),
               "TopKDispatch");
}

}  // namespace jaxsample_flashinfer

