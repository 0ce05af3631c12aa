"""GPU: generate with the Pallas kernels on the embedded model.

Run on the GPU machine with ``python -m pytest -m gpu tests/test_gpu_serve_loop.py``.
"""

import jax
import numpy as np
import pytest

import jaxsample as js
from jaxsample import serve_loop
from jaxsample.demo import PROMPTS, SETTINGS
from jaxsample.models import load_embedded

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("require_gpu")]


@pytest.fixture(scope="module")
def embedded():
  return load_embedded()


def run(embedded, indices, implementation, return_masks=False):
  model, tokenizer = embedded
  prompts = [tokenizer.encode(PROMPTS[i]).ids for i in indices]
  _, t, k, p, m = zip(*[SETTINGS[i % len(SETTINGS)] for i in indices])
  params = js.SamplingParams.make(len(indices), temperature=t, top_k=k,
                                  top_p=p, min_p=m)
  keys = jax.random.split(jax.random.key(0), len(PROMPTS))[np.asarray(indices)]
  return serve_loop.generate(
      model, prompts, params=params, keys=keys, max_new_tokens=40,
      config=js.SamplerConfig(implementation=implementation),
      return_masks=return_masks)


def test_kernels_generate_the_xla_tokens(embedded):
  indices = list(range(len(PROMPTS)))
  xla = run(embedded, indices, "xla", return_masks=True)
  pallas = run(embedded, indices, "pallas", return_masks=True)
  np.testing.assert_array_equal(xla.tokens, pallas.tokens)
  np.testing.assert_allclose(xla.logprobs, pallas.logprobs, atol=1e-4)
  for a, b in zip(xla.to_openai(), pallas.to_openai()):
    np.testing.assert_allclose(a["logz"], b["logz"], atol=1e-4)
    assert a["sampling_mask"] == b["sampling_mask"]


def test_request_alone_equals_its_row_in_a_batch_on_gpu(embedded):
  indices = list(range(len(PROMPTS)))
  full = run(embedded, indices, "pallas").to_openai()
  for i in (0, 3, 5):
    alone = run(embedded, [i], "pallas").to_openai()[0]
    assert alone["token_ids"] == full[i]["token_ids"]
    assert alone["logprobs"] == full[i]["logprobs"]
  reordered = run(embedded, indices[::-1], "pallas").to_openai()
  assert [c["token_ids"] for c in reordered[::-1]] == [
      c["token_ids"] for c in full]
