// A launcher of jaxsample's FlashInfer binding (common.h).
// sampling.cuh first: FlashInfer's topk.cuh uses names that sampling.cuh brings in.
#include <flashinfer/sampling.cuh>

#include "common.h"

namespace jaxsample_flashinfer {

namespace sampling = flashinfer::sampling;

void sampling_from_logits(at::Tensor logits, at::Tensor tokens, uint64_t seed,
                          uint64_t offset) {
  check_rows_and_outputs(logits, tokens, nullptr);
  check_status(sampling::SamplingFromLogits<float, int32_t>(
                   logits.data_ptr<float>(), tokens.data_ptr<int32_t>(), nullptr,
                   logits.size(0), logits.size(1), kDeterministic, nullptr, seed, nullptr,
                   offset, current_stream()),
               "SamplingFromLogits");
}

}  // namespace jaxsample_flashinfer

