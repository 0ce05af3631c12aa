"""GPU tests of the report's non-JAX peers: torch's sort sampler, vLLM's
Triton kernels loaded from a local copy of vLLM's source
(``jaxsample.bench.vllm_peers``) and FlashInfer's CUDA kernels built from a
local copy of FlashInfer's source (``jaxsample.bench.flashinfer_peers``).

Run on the GPU machine with the copies at ``.peers/vllm`` and
``.peers/flashinfer`` (or ``$JAXSAMPLE_VLLM_SRC``,
``$JAXSAMPLE_FLASHINFER_SRC``): ``PYTHONPATH=. python3 -m pytest -m gpu
tests/test_gpu_peers.py``.  Skipped without a GPU, without torch on CUDA, or
(the vLLM / FlashInfer tests) without the copy.  The vLLM sampler must keep
exactly the top token under filters that keep one token, and sample a small
row's distribution (total variation bounded by the sample count); FlashInfer's
paths must draw only tokens of the kept set.
"""

from __future__ import annotations

import json
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsample.bench import cases, cli, flashinfer_peers, peers, vllm_peers

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("require_gpu")]

ROOT = pathlib.Path(__file__).resolve().parents[1]
VLLM_SRC = os.environ.get(vllm_peers.ENV_VAR) or str(ROOT / ".peers" / "vllm")
FLASHINFER_SRC = os.environ.get(flashinfer_peers.ENV_VAR) or str(ROOT / ".peers" / "flashinfer")
VOCAB = 151936


@pytest.fixture(scope="module")
def torch():
  module = peers.torch_module()
  if module is None:
    pytest.skip("needs torch with CUDA")
  return module


def _load_copy(module, source: str):
  """``module.load(source)`` (a copied peer), or a skip naming the missing copy."""
  try:
    module.resolve_source(source)
  except ValueError as error:  # VllmSourceError, FlashInferSourceError
    pytest.skip(f"needs the source copy: {error}")
  return module.load(source)


@pytest.fixture(scope="module")
def kernels(torch):
  return _load_copy(vllm_peers, VLLM_SRC)


def _peaked_rows(batch: int, vocab: int, dtype, seed: int):
  """``2 N(0, 1)`` rows with one token 8 above the rest at a random id, and its ids."""
  key_x, key_id = jax.random.split(jax.random.key(seed))
  x = 2 * jax.random.normal(key_x, (batch, vocab), jnp.float32)
  ids = jax.random.randint(key_id, (batch,), 0, vocab)
  x = x.at[jnp.arange(batch), ids].set(jnp.max(x, axis=-1) + 8)
  return x.astype(dtype), np.asarray(ids)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("batch", [4, 100])  # <= 64: vLLM's split top-p pipeline
@pytest.mark.parametrize("filters", [dict(top_k=1), dict(top_p=1e-6), dict(min_p=0.5),
                                     dict(top_k=50, top_p=1e-6)], ids=str)
def test_vllm_sampler_keeps_only_the_top_token(kernels, torch, filters, batch, dtype):
  x, top = _peaked_rows(batch, VOCAB, dtype, seed=batch)
  sample = vllm_peers._sampler(kernels, torch, batch, filters, 0.7, plain=False)
  tokens = sample(torch.from_dlpack(jax.block_until_ready(x))).cpu().numpy()
  np.testing.assert_array_equal(tokens, top)


def test_vllm_samplers_draw_the_row_distribution(kernels, torch):
  """Many rows of one small distribution, each with its own seed: plain
  (``gumbel_sample`` alone and the whole path) and top-k 4 frequencies within
  a total-variation bound of the exact probabilities."""
  vocab, rows, temperature = 16, 8192, 0.7
  logits = np.linspace(-2.0, 1.5, vocab, dtype=np.float32)
  x = jnp.broadcast_to(jnp.asarray(logits), (rows, vocab))
  tensor = torch.from_dlpack(jax.block_until_ready(x))
  bound = 3 * np.sqrt(vocab / rows)
  for filters, plain in (({}, True), ({}, False), (dict(top_k=4), False)):
    sample = vllm_peers._sampler(kernels, torch, rows, filters, temperature, plain)
    tokens = sample(tensor).cpu().numpy()
    want = np.exp((logits - logits.max()) / temperature)
    if filters:
      want[:-4] = 0
      assert set(np.unique(tokens)) <= set(range(vocab - 4, vocab))
    want /= want.sum()
    got = np.bincount(tokens, minlength=vocab) / rows
    assert 0.5 * np.abs(got - want).sum() < bound, (filters, plain, got, want)


def test_time_torch_replays_a_graph(torch):
  rows = [_peaked_rows(8, VOCAB, jnp.float32, seed)[0] for seed in range(3)]
  result = peers.time_torch(peers.torch_sort_sampler(torch, dict(top_k=50, top_p=0.9), 0.7),
                            rows, iters=4, repeats=2)
  assert result["graph"], result
  assert result["us"] > 0 and result["wall_us"] > 0


def test_report_times_every_peer(kernels, tmp_path):
  out = tmp_path / "report"
  assert cli.main(["report", "--out", str(out), "--batch", "1,100", "--vocab", str(VOCAB),
                   "--dtypes", "bfloat16", "--settings", "plain,top_p0.95,min_p0.05",
                   "--quick", "--no-spec", "--peers", "jax,torch,vllm",
                   "--vllm-src", str(kernels.root), "--no-progress"]) == 0
  doc = json.loads((out / "report.json").read_text())
  assert doc["peers"]["failures"] == [] and doc["peers"]["vllm"]["commit"] == kernels.commit
  for setting in ("plain", "top_p0.95", "min_p0.05"):
    for batch in (1, 100):
      found = {r["op"]: r for r in doc["rows"] if r["setting"] == setting and
               r["batch"] == batch}
      for name in (vllm_peers.SAMPLER, vllm_peers.GUMBEL, peers.TORCH_SORT):
        assert found[name]["graph"] and found[name]["us"] > 0, (setting, batch, name)
  md = (out / "report.md").read_text()
  assert vllm_peers.SAMPLER in md and str(kernels.commit) in md


@pytest.fixture(scope="module")
def flashinfer(torch):
  return _load_copy(flashinfer_peers, FLASHINFER_SRC)


def _kept(logits: np.ndarray, filters: dict, temperature: float, joint: bool = False,
          slack: float = 1e-4):
  """Per row, a boolean mask of the tokens the filters may keep: the exact kept
  set widened by ``slack`` in probability (summation order moves the top-p and
  min-p boundaries by float rounding).  Top-p applies within the top k,
  renormalized (FlashInfer's ``top_k_first``), or with ``joint`` to the whole
  row's mass (its joint kernel: both filters on the row's probabilities)."""
  x = logits.astype(np.float64) / temperature
  probs = np.exp(x - x.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  keep = np.ones_like(probs, dtype=bool)
  order = np.argsort(-probs, axis=-1, kind="stable")
  ranked = np.take_along_axis(probs, order, -1)
  if filters.get("top_k"):
    kth = ranked[:, filters["top_k"] - 1:filters["top_k"]]
    keep &= probs >= kth * (1 - slack)
    if not joint:  # top-p within the top k
      ranked = np.where(np.arange(ranked.shape[1]) < filters["top_k"], ranked, 0)
      ranked /= ranked.sum(-1, keepdims=True)
  if filters.get("top_p", 1.0) < 1:
    before = np.cumsum(ranked, -1) - ranked  # mass of the higher-ranked tokens
    inside = np.zeros_like(keep)
    np.put_along_axis(inside, order, before < filters["top_p"] + slack, -1)
    keep &= inside
  if filters.get("min_p"):
    keep &= probs >= filters["min_p"] * probs.max(-1, keepdims=True) * (1 - slack)
  return keep


@pytest.mark.parametrize("filters,joint", [
    (dict(top_k=50, top_p=0.9), False), (dict(top_k=50, top_p=0.9), True),
    (dict(top_p=0.95), False), (dict(top_p=0.9), False), (dict(min_p=0.1), False),
    (dict(top_k=50), False)], ids=str)
@pytest.mark.parametrize("dist", ["llm", "randn"])
def test_flashinfer_draws_only_kept_tokens(flashinfer, torch, filters, joint, dist):
  """Rows of a few head tokens (``llm``: small kept sets) or of ``2 N(0, 1)``
  (``randn``: kept sets of up to tens of thousands); every token of 8 calls
  (fresh offsets) is in the row's kept set, and the kept sets are not all one
  token."""
  batch, temperature = 32, 0.7
  x = jax.block_until_ready(cases.make_logits(jax.random.key(3), batch, VOCAB, dist))
  sample = flashinfer_peers._sampler(flashinfer, torch, (batch, VOCAB), filters, temperature,
                                     joint)
  keep = _kept(np.asarray(x), filters, temperature, joint)
  tensor = torch.from_dlpack(x)
  tokens = np.stack([sample(tensor).cpu().numpy() for _ in range(8)], axis=1)
  assert tokens.dtype == np.int32 and tokens.shape == (batch, 8)
  inside = np.take_along_axis(keep, tokens.astype(np.int64), -1)
  assert inside.all(), (filters, joint, np.argwhere(~inside)[:5])
  assert keep.sum(-1).max() > 1


def test_flashinfer_plain_draws_the_row_distribution(flashinfer, torch):
  """Many rows of one small distribution: the plain path's frequencies within a
  total-variation bound of the exact probabilities at T = 0.7."""
  vocab, rows, temperature = 16, 8192, 0.7
  logits = np.linspace(-2.0, 1.5, vocab, dtype=np.float32)
  x = jnp.broadcast_to(jnp.asarray(logits), (rows, vocab))
  sample = flashinfer_peers._sampler(flashinfer, torch, (rows, vocab), {}, temperature, False)
  tokens = sample(torch.from_dlpack(jax.block_until_ready(x))).cpu().numpy()
  want = np.exp((logits - logits.max()) / temperature)
  want /= want.sum()
  got = np.bincount(tokens, minlength=vocab) / rows
  assert 0.5 * np.abs(got - want).sum() < 3 * np.sqrt(vocab / rows), (got, want)


def test_report_times_the_flashinfer_peers(flashinfer, tmp_path):
  out = tmp_path / "report"
  assert cli.main(["report", "--out", str(out), "--batch", "1,64", "--vocab", str(VOCAB),
                   "--dtypes", "float32", "--settings", "plain,top_k50+top_p0.9,min_p0.1",
                   "--quick", "--no-spec", "--mask-caps", "", "--peers", "jax,flashinfer",
                   "--flashinfer-src", str(flashinfer.root), "--no-progress"]) == 0
  doc = json.loads((out / "report.json").read_text())
  assert doc["peers"]["failures"] == []
  assert doc["peers"]["flashinfer"]["commit"] == flashinfer.commit
  found = {(r["op"], r["setting"], r["batch"]): r for r in doc["rows"]}
  for batch in (1, 64):
    for setting in ("plain", "top_k50+top_p0.9", "min_p0.1"):
      row = found[(flashinfer_peers.SAMPLER, setting, batch)]
      assert row["graph"] and row["us"] > 0, (setting, batch)
    assert found[(flashinfer_peers.JOINT, "top_k50+top_p0.9", batch)]["graph"]
    assert (flashinfer_peers.JOINT, "plain", batch) not in found  # not the joint peer's
  assert flashinfer_peers.SAMPLER in (out / "report.md").read_text()
