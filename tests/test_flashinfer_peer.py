"""FlashInfer's sampling kernels as report peers (``jaxsample.bench.flashinfer_peers``).

On CPU: source resolution (errors name the fix), build flags, the API path each
setting takes, registration in the report, a copy that fails to build.  On a GPU
(``gpu``-marked; skipped without torch on CUDA or without the source copy at
``.peers/flashinfer`` or ``$JAXSAMPLE_FLASHINFER_SRC``): our binding is built
against the copy, every path draws only tokens of the kept set, and the plain
path draws a small row's distribution (total variation bounded by the sample
count)."""

import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import peers as helpers_peers
from jaxsample.bench import cases, cli, flashinfer_peers, peers, report, vllm_peers

ROOT = pathlib.Path(__file__).resolve().parents[1]
FLASHINFER_SRC = os.environ.get(flashinfer_peers.ENV_VAR) or str(ROOT / ".peers" / "flashinfer")
VOCAB = 151936


def test_flashinfer_resolve_source_names_the_fix(tmp_path, monkeypatch):
  monkeypatch.delenv(flashinfer_peers.ENV_VAR, raising=False)
  with pytest.raises(flashinfer_peers.FlashInferSourceError,
                     match="--flashinfer-src PATH or set JAXSAMPLE_FLASHINFER_SRC"):
    flashinfer_peers.resolve_source(None)
  with pytest.raises(flashinfer_peers.FlashInferSourceError, match="no such folder"):
    flashinfer_peers.resolve_source(tmp_path / "absent")
  partial = helpers_peers.source_tree(tmp_path / "partial", flashinfer_peers.FILES[:2])
  with pytest.raises(flashinfer_peers.FlashInferSourceError) as error:
    flashinfer_peers.resolve_source(partial)
  assert "include/flashinfer/vec_dtypes.cuh" in str(error.value)
  assert "include/flashinfer/sampling.cuh" not in str(error.value)
  full = helpers_peers.source_tree(tmp_path / "full", flashinfer_peers.FILES)
  assert flashinfer_peers.resolve_source(full) == full
  monkeypatch.setenv(flashinfer_peers.ENV_VAR, str(full))
  assert flashinfer_peers.resolve_source(None) == full
  (full / "COMMIT").write_text("fb28d72 flashinfer-ai/flashinfer\n")
  assert flashinfer_peers.source_commit(full) == "fb28d72 flashinfer-ai/flashinfer"


def test_flashinfer_kernels_describe_the_copy_and_the_build(tmp_path):
  kernels = flashinfer_peers.FlashInferKernels(root=tmp_path, commit="fb28d72", module=None,
                                               build_s=93.25)
  assert kernels.describe() == dict(source=str(tmp_path), commit="fb28d72",
                                    files=list(flashinfer_peers.FILES), build_s=93.2)


def test_flashinfer_binding_sources_are_shipped():
  module, *launchers = flashinfer_peers.SOURCES
  assert module.name == "binding.cpp" and "PYBIND11_MODULE" in module.read_text()
  exported = module.read_text().count("m.def(")
  assert len(launchers) == exported == 7
  for source in launchers:
    assert "#include <flashinfer/sampling.cuh>" in source.read_text(), source


def test_flashinfer_build_flags_name_one_architecture():
  flags = flashinfer_peers.build_flags((9, 0))
  assert [f for f in flags if "arch" in f] == ["-gencode=arch=compute_90,code=sm_90"]
  assert "-U__CUDA_NO_HALF_OPERATORS__" in flags and "-U__CUDA_NO_HALF2_OPERATORS__" in flags
  assert "-gencode=arch=compute_100,code=sm_100" in flashinfer_peers.build_flags((10, 0))


@pytest.mark.parametrize("filters,joint,vocab,want", [
    ({}, False, 151936, "logits"),
    (dict(top_k=50, top_p=0.9), False, 151936, "top_k_first"),
    (dict(top_k=256, top_p=0.9), False, 65536, "top_k_first"),
    (dict(top_k=257, top_p=0.9), False, 151936, None),  # FlashInfer's masking fallback
    (dict(top_k=50, top_p=0.9), False, 32000, None),  # below the fast path's vocabulary
    (dict(top_k=50, top_p=0.9), True, 151936, "joint"),
    (dict(top_k=50, top_p=0.9), True, 32000, "joint"),
    (dict(top_p=0.95), False, 151936, "top_p"),
    (dict(top_p=0.95), True, 151936, None),
    (dict(min_p=0.1), False, 151936, "min_p"),
    (dict(top_k=50), False, 151936, "top_k"),
    (dict(top_k=50, min_p=0.1), False, 151936, None),
    (dict(top_p=1.0), False, 151936, "logits"),
], ids=str)
def test_flashinfer_plan_picks_the_api_path(filters, joint, vocab, want):
  assert flashinfer_peers.plan(filters, 0.7, vocab, joint) == want


def test_flashinfer_plan_times_nothing_at_temperature_zero():
  assert flashinfer_peers.plan({}, 0.0, 151936, False) is None
  assert flashinfer_peers.plan(dict(top_k=50, top_p=0.9), 0.0, 151936, True) is None


def test_torch_peer_times_nothing_where_the_sampler_declines(monkeypatch):
  made = []

  def make(torch, shape, filters, temperature):
    made.append((shape, filters, temperature))
    return None

  monkeypatch.setattr(peers, "torch_module", lambda: object())
  rows = [np.zeros((3, 16), np.float32)]
  assert peers.torch_peer(make)({"top_p": 0.9}, 0.7)(rows, 2, 1) is None
  assert made == [((3, 16), {"top_p": 0.9}, 0.7)]
  monkeypatch.setattr(peers, "torch_module", lambda: None)
  assert peers.torch_peer(make)({}, 0.7)(rows, 2, 1) is None and len(made) == 1


def test_report_registers_flashinfer_beside_vllm(tmp_path, monkeypatch):
  assert "flashinfer" in report.PEERS
  opts = cli.parser().parse_args(["report", "--flashinfer-src", str(tmp_path)])
  assert opts.flashinfer_src == str(tmp_path) and opts.vllm_src == ""
  monkeypatch.setattr(peers, "torch_module", lambda: object())  # as on the GPU machine
  monkeypatch.delenv(vllm_peers.ENV_VAR, raising=False)
  assert report.chosen_peers(opts) == {"jax", "torch", "flashinfer"}  # auto: the copy given
  monkeypatch.delenv(flashinfer_peers.ENV_VAR, raising=False)
  bare = cli.parser().parse_args(["report"])
  assert report.chosen_peers(bare) == {"jax", "torch"}
  monkeypatch.setenv(flashinfer_peers.ENV_VAR, str(tmp_path))
  assert report.chosen_peers(bare) == {"jax", "torch", "flashinfer"}


def test_report_records_a_copy_that_fails_to_build(tmp_path, monkeypatch, capsys):
  def broken(path):
    raise RuntimeError("nvcc: error in sampling.cuh")

  monkeypatch.setattr(flashinfer_peers, "load", broken)
  failures = []
  opts = cli.parser().parse_args(["report", "--flashinfer-src", str(tmp_path)])
  assert report.load_copied({"jax", "flashinfer"}, opts, failures) == {}
  assert failures[0]["peer"] == "flashinfer (loading the source copy)"
  assert "nvcc: error in sampling.cuh" in failures[0]["error"]
  assert "left out" in capsys.readouterr().err


@pytest.fixture(scope="module")
def flashinfer(torch):
  return helpers_peers.load_copy(flashinfer_peers, FLASHINFER_SRC)


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


@pytest.mark.gpu
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
  sample = flashinfer_peers.sampler(flashinfer, torch, (batch, VOCAB), filters, temperature,
                                     joint)
  keep = _kept(np.asarray(x), filters, temperature, joint)
  tensor = torch.from_dlpack(x)
  tokens = np.stack([sample(tensor).cpu().numpy() for _ in range(8)], axis=1)
  assert tokens.dtype == np.int32 and tokens.shape == (batch, 8)
  inside = np.take_along_axis(keep, tokens.astype(np.int64), -1)
  assert inside.all(), (filters, joint, np.argwhere(~inside)[:5])
  assert keep.sum(-1).max() > 1


@pytest.mark.gpu
def test_flashinfer_plain_draws_the_row_distribution(flashinfer, torch):
  """Many rows of one small distribution: the plain path's frequencies within a
  total-variation bound of the exact probabilities at T = 0.7."""
  vocab, rows, temperature = 16, 8192, 0.7
  logits = np.linspace(-2.0, 1.5, vocab, dtype=np.float32)
  x = jnp.broadcast_to(jnp.asarray(logits), (rows, vocab))
  sample = flashinfer_peers.sampler(flashinfer, torch, (rows, vocab), {}, temperature, False)
  tokens = sample(torch.from_dlpack(jax.block_until_ready(x))).cpu().numpy()
  want = np.exp((logits - logits.max()) / temperature)
  want /= want.sum()
  got = np.bincount(tokens, minlength=vocab) / rows
  assert 0.5 * np.abs(got - want).sum() < 3 * np.sqrt(vocab / rows), (got, want)


@pytest.mark.gpu
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
