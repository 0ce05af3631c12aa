"""GPU: the ServeLoop with the Pallas kernels on the embedded model.

Run on the GPU machine with ``python -m pytest -m gpu tests/test_gpu_serving.py``.
"""

import dataclasses

import jax
import numpy as np
import pytest

import jaxsample as js
from jaxsample.models import EMBEDDED_DIR, load_embedded
from jaxsample.serve_demo import PROMPTS, SETTINGS
from jaxsample.serve_loop import (ModelDrafter, NgramDrafter, Request,
                                  ServeLoop, Speculation, generate,
                                  layer_prefix)

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("require_gpu")]
KERNELS = js.SamplerConfig(implementation="pallas", max_mask_ids=64)


@pytest.fixture(scope="module")
def embedded():
  if not (EMBEDDED_DIR / "config.json").exists():
    pytest.skip(f"no embedded model in {EMBEDDED_DIR} (scripts/train_model.py)")
  return load_embedded()


@pytest.fixture(autouse=True)
def full_precision_matmuls():
  """fp32 matmuls at full precision.  Under JAX's GPU default (TF32) the
  model's logits depend on the batch shape by ~1e-3, and the loop (4 slots)
  and ``generate`` (8 rows) run different shapes: logprobs then differ by
  up to 7.6e-4 (H100; tokens and masks equal).  With "highest" the test
  passes (H100, JAX_DEFAULT_MATMUL_PRECISION=highest,
  benchmarks/results/2026-11-26g-h100-serving/)."""
  with jax.default_matmul_precision("highest"):
    yield


def requests(tokenizer, count, **change):
  return [dataclasses.replace(Request(
      prompt=tokenizer.encode(PROMPTS[i % len(PROMPTS)]).ids, max_tokens=32,
      seed=i, request_id=i, stop=[0], **SETTINGS[i % len(SETTINGS)][1]),
      **change) for i in range(count)]


def test_loop_equals_generate_with_kernels(embedded):
  model, tokenizer = embedded
  batch = requests(tokenizer, 8, return_masks=True)
  expected = generate(
      model, [r.prompt for r in batch],
      params=js.SamplingParams.make(8, **{
          f: [getattr(r, f) for r in batch]
          for f in ("temperature", "top_k", "top_p", "min_p")}),
      keys=np.stack([jax.random.key_data(jax.random.PRNGKey(r.seed))
                     for r in batch]),
      max_new_tokens=32, stop_tokens=[[0]] * 8, config=KERNELS,
      return_masks=True).to_openai()
  loop = ServeLoop(model, slots=4, config=KERNELS, return_masks=True)
  for done, choice in zip(loop.run(batch), expected):
    assert done.token_ids == choice["token_ids"]
    np.testing.assert_allclose(done.logprobs, choice["logprobs"], atol=1e-4)
    assert done.sampling_mask == choice["sampling_mask"]


@pytest.mark.parametrize("drafter", ["ngram", "layers"])
def test_greedy_speculation_on_kernels(embedded, drafter):
  model, tokenizer = embedded
  batch = requests(tokenizer, 8, temperature=0.0, return_masks=True)
  spec = (Speculation(NgramDrafter(4)) if drafter == "ngram" else
          Speculation(ModelDrafter(layer_prefix(model, 1)[0], 4, KERNELS),
                      layer_prefix(model, 1)[1]))
  plain = ServeLoop(model, slots=4, config=KERNELS, return_masks=True)
  fast = ServeLoop(model, slots=4, config=KERNELS, return_masks=True,
                   speculation=spec)
  accepted = 0
  for a, b in zip(plain.run(batch), fast.run(batch)):
    assert a.token_ids == b.token_ids
    assert a.sampling_mask == b.sampling_mask
    accepted += b.accepted
  assert accepted > 0
