// A launcher of jaxsample's FlashInfer binding (common.h).
// sampling.cuh first: FlashInfer's topk.cuh uses names that sampling.cuh brings in.
#include <flashinfer/sampling.cuh>

#include "common.h"

namespace jaxsample_flashinfer {

namespace sampling = flashinfer::sampling;

void softmax(at::Tensor logits, at::Tensor probs, at::Tensor workspace, double temperature,
             bool enable_pdl) {
  check_tensor(logits, "logits", 2, at::kFloat);
  check_tensor(probs, "probs", 2, at::kFloat);
  check_tensor(workspace, "workspace", 1, at::kByte);
  TORCH_CHECK(probs.sizes() == logits.sizes(), "probs must have the shape of logits");
  check_status(sampling::OnlineSoftmax<float>(
                   logits.data_ptr<float>(), probs.data_ptr<float>(), logits.size(0),
                   logits.size(1), /*temperature_arr=*/nullptr, static_cast<float>(temperature),
                   workspace.data_ptr(), workspace.numel(), enable_pdl, current_stream()),
               "OnlineSoftmax");
}

}  // namespace jaxsample_flashinfer

