// jaxsample's binding of FlashInfer's sampling launchers (include/flashinfer/sampling.cuh
// of the local source copy) for the benchmark peers of jaxsample/bench/flashinfer_peers.py.
// Every launcher runs on torch's current stream (so CUDA graphs capture it), with
// FlashInfer's defaults: deterministic kernels, no row indices, scalar parameters, and the
// Philox `seed` and `offset` that FlashInfer's Python API takes from torch's generator.
#include <flashinfer/sampling.cuh>

#include "common.h"

namespace jaxsample_flashinfer {

namespace sampling = flashinfer::sampling;
constexpr bool kDeterministic = true;  // FlashInfer's Python default

// OnlineSoftmax: probs = softmax(logits / temperature); `workspace` is FlashInfer's 1 MiB
// buffer for the split-vocabulary path.
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

void sampling_from_logits(at::Tensor logits, at::Tensor tokens, uint64_t seed,
                          uint64_t offset) {
  check_rows_and_outputs(logits, tokens, nullptr);
  check_status(sampling::SamplingFromLogits<float, int32_t>(
                   logits.data_ptr<float>(), tokens.data_ptr<int32_t>(), nullptr,
                   logits.size(0), logits.size(1), kDeterministic, nullptr, seed, nullptr,
                   offset, current_stream()),
               "SamplingFromLogits");
}

void top_k_sampling_from_probs(at::Tensor probs, at::Tensor tokens, at::Tensor valid,
                               int64_t top_k, uint64_t seed, uint64_t offset) {
  check_rows_and_outputs(probs, tokens, &valid);
  check_status(sampling::TopKSamplingFromProb<float, int32_t>(
                   probs.data_ptr<float>(), tokens.data_ptr<int32_t>(), valid.data_ptr<bool>(),
                   nullptr, /*top_k_arr=*/nullptr, probs.size(0), top_k, probs.size(1),
                   kDeterministic, nullptr, seed, nullptr, offset, current_stream()),
               "TopKSamplingFromProb");
}

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

void min_p_sampling_from_probs(at::Tensor probs, at::Tensor tokens, at::Tensor valid,
                               double min_p, uint64_t seed, uint64_t offset) {
  check_rows_and_outputs(probs, tokens, &valid);
  check_status(sampling::MinPSamplingFromProb<float, int32_t>(
                   probs.data_ptr<float>(), /*min_p_arr=*/nullptr, tokens.data_ptr<int32_t>(),
                   valid.data_ptr<bool>(), nullptr, probs.size(0), static_cast<float>(min_p),
                   probs.size(1), kDeterministic, nullptr, seed, nullptr, offset,
                   current_stream()),
               "MinPSamplingFromProb");
}

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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace jf = jaxsample_flashinfer;
  m.def("softmax", &jf::softmax);
  m.def("sampling_from_logits", &jf::sampling_from_logits);
  m.def("top_k_sampling_from_probs", &jf::top_k_sampling_from_probs);
  m.def("top_p_sampling_from_probs", &jf::top_p_sampling_from_probs);
  m.def("min_p_sampling_from_probs", &jf::min_p_sampling_from_probs);
  m.def("top_k_top_p_sampling_from_probs", &jf::top_k_top_p_sampling_from_probs);
  m.def("radix_top_k", &jf::radix_top_k);
}
