// The Python module of jaxsample's FlashInfer binding (common.h says what each launcher does).
#include <torch/extension.h>

#include "common.h"

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
