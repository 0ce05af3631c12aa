// A launcher of jaxsample's FlashInfer binding (common.h).
// sampling.cuh first: FlashInfer's topk.cuh uses names that sampling.cuh brings in.
#include <flashinfer/sampling.cuh>

#include "common.h"

namespace jaxsample_flashinfer {

namespace sampling = flashinfer::sampling;

void top_p_sampling_from_probs(at::Tensor probs, at::Tensor tokens, at::Tensor valid,
                               double top_p, uint64_t seed, uint64_t offset) {
  check_rows_and_outputs(probs, tokens, &valid);
  check_status(sampling::TopPSamplingFromProb<float, int32_t>(
                   probs.data_ptr<float>(), tokens.data_ptr<int32_t>(), valid.data_ptr<bool>(),
                   nullptr, /*top_p_arr=*/nullptr, probs.size(0), static_cast<float>(top_p),
                   probs.size(1), kDeterministic, nullptr, seed, nullptr, offset,
                   current_stream()),
               "TopPSamplingFromProb");
}

}  // namespace jaxsample_flashinfer

