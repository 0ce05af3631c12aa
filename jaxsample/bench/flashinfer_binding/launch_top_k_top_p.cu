// A launcher of jaxsample's FlashInfer binding (common.h).
// sampling.cuh first: FlashInfer's topk.cuh uses names that sampling.cuh brings in.
#include <flashinfer/sampling.cuh>

#include "common.h"

namespace jaxsample_flashinfer {

namespace sampling = flashinfer::sampling;

void top_k_top_p_sampling_from_probs(at::Tensor probs, at::Tensor tokens, at::Tensor valid,
                                     int64_t top_k, double top_p, uint64_t seed,
                                     uint64_t offset) {
  check_rows_and_outputs(probs, tokens, &valid);
  check_status(sampling::TopKTopPSamplingFromProb<float, int32_t>(
                   probs.data_ptr<float>(), /*top_k_arr=*/nullptr, /*top_p_arr=*/nullptr,
                   tokens.data_ptr<int32_t>(), valid.data_ptr<bool>(), nullptr, probs.size(0),
                   static_cast<int32_t>(top_k), static_cast<float>(top_p), probs.size(1),
                   kDeterministic, nullptr, seed, nullptr, offset, current_stream()),
               "TopKTopPSamplingFromProb");
}

}  // namespace jaxsample_flashinfer

