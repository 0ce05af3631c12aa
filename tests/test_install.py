"""A plain install (no extras) runs the library: the core API, ``decode_step``,
``generate`` and ``ServeLoop`` with a user's own Flax NNX model, and the
demos' ``--help``; the embedded model's loaders name the ``models`` extra.

The check runs in a fresh interpreter whose import system refuses the
packages the extras bring (safetensors, tokenizers: ``models``; tqdm,
matplotlib: ``bench``, ``train``; torch and jinja2, which some stacks carry).
optax is a dependency of flax itself (``flax.nnx`` imports it), so every
install has it.  CI's compatibility tier (``scripts/dev compat``) runs this
file against a wheel installed without extras; the default tier leaves the
interpreter's run (``slow``) to it.
"""

import os
import pathlib
import re
import subprocess
import sys
import tomllib

import jax
import pytest

from conftest import COMPAT_TESTS

pytestmark = pytest.mark.compat

BLOCKED = ("safetensors", "tokenizers", "tqdm", "matplotlib", "torch", "jinja2")

_WITHOUT_EXTRAS = """
import importlib.abc, sys
BLOCKED = set(sys.argv[1].split(","))

class Refuse(importlib.abc.MetaPathFinder):
  def find_spec(self, name, path=None, target=None):
    if name.partition(".")[0] in BLOCKED:
      raise ModuleNotFoundError(f"No module named {name!r}", name=name)
    return None

sys.meta_path.insert(0, Refuse())

import jax, jax.numpy as jnp, numpy as np
from flax import nnx
import jaxsample as js
from jaxsample import serve_loop
from jaxsample.serve_loop import DecodeState, NnxLM, Request, ServeLoop, decode_step

V, B = 16, 2
logits = jnp.asarray(np.random.default_rng(0).normal(size=(B, V)), jnp.float32)
params = js.SamplingParams.make(B, temperature=[0.0, 0.8], top_p=[1.0, 0.9])
out = jax.jit(lambda x: js.sample(x, params, jax.random.key(0)))(logits)
assert int(out.tokens[0]) == int(jnp.argmax(logits[0])) and bool(out.valid.all())
mask = js.extract_sampling_mask(logits, params)
assert int(mask.count[0]) == 1 and int(mask.ids[0, 0]) == int(out.tokens[0])
spec = js.rejection_sample(jnp.stack([logits, logits], 1),
                           jnp.argmax(logits, -1)[:, None].astype(jnp.int32),
                           jnp.ones(B, jnp.int32), params, jax.random.key(1))
assert spec.tokens.shape == (B, 2) and int(spec.num_accepted[0]) == 1


sys.path.insert(0, sys.argv[2])  # tests/: helpers.toy_lm
from helpers.toy_lm import Bigram  # a user's own NNX module

model = Bigram(V, nnx.Rngs(0))
table = np.asarray(model.table.embedding[...])
greedy = js.SamplingParams.make(B, temperature=0.0)
gen = serve_loop.generate(model, [[1, 2], [3]], params=greedy,
                          keys=jax.random.split(jax.random.key(0), B),
                          max_new_tokens=4, cache_len=16)
want = []
for last in (2, 3):
  chain = []
  for _ in range(4):
    last = int(np.argmax(table[last]))
    chain.append(last)
  want.append(chain)
got = [np.asarray(gen.tokens)[b, :int(gen.num_tokens[b])].tolist() for b in range(B)]
assert got == want, (got, want)

lm, weights = NnxLM.split(model)
state = DecodeState(tokens=jnp.asarray([2, 3]), positions=jnp.asarray([1, 0]),
                    keys=jax.random.key_data(jax.random.split(jax.random.key(0), B)),
                    params=greedy, finished=jnp.zeros(B, bool),
                    stop_tokens=jnp.full((B, 1), -1, jnp.int32),
                    remaining=jnp.full(B, 4, jnp.int32),
                    cache=lm.init_cache(weights, B, 16))
state, step = jax.jit(lambda s: decode_step(lm, weights, s))(state)
assert np.asarray(step.tokens).tolist() == [w[0] for w in want]

done = ServeLoop(model, slots=2, cache_len=16).run(
    [Request(prompt=p, max_tokens=4, temperature=0.0, request_id=i)
     for i, p in enumerate([[1, 2], [3]])])
assert [c.token_ids for c in sorted(done, key=lambda c: c.request_id)] == want

from jaxsample import demo, serve_demo
for main in (demo.main, serve_demo.main):
  try:
    main(["--help"])
  except SystemExit as stop:
    assert stop.code == 0, stop.code
from jaxsample.models import load_embedded
try:
  load_embedded()
except ImportError as err:
  assert 'pip install "jaxsample[models]"' in str(err), err
else:
  raise AssertionError("load_embedded ran without safetensors")
loaded = sorted(m for m in sys.modules if m.partition(".")[0] in BLOCKED)
assert not loaded, loaded
print("CORE OK")
"""


@pytest.mark.slow  # the compatibility tier runs it (docs/testing.md, "Tiers")
def test_core_runs_without_the_extras():
  env = dict(os.environ)
  cache = jax.config.jax_compilation_cache_dir
  if cache:  # the suite's compile cache (tests/conftest.py)
    env.update(JAX_COMPILATION_CACHE_DIR=cache,
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0.1")
  run = subprocess.run([sys.executable, "-P", "-c", _WITHOUT_EXTRAS, ",".join(BLOCKED),
                        str(pathlib.Path(__file__).parent)],
                       capture_output=True, text=True, env=env, timeout=600)
  assert run.returncode == 0 and "CORE OK" in run.stdout, run.stdout + run.stderr


# ---------------------------------------------------------------------------
# What the README's Install section and CI promise.
# ---------------------------------------------------------------------------

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _project() -> dict:
  return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _name(requirement: str) -> str:
  """``jax[cuda13]>=0.11.2`` -> ``jax[cuda13]``; ``jaxsample[models]`` -> ``models``."""
  name = re.split(r"[<>=!~ ;]", requirement, maxsplit=1)[0]
  return name[len("jaxsample["):-1] if name.startswith("jaxsample[") else name


def test_readme_extras_table_is_pyprojects():
  readme = (ROOT / "README.md").read_text()
  table = readme[readme.index("| extra | adds | for |"):].split("\n\n")[0]
  rows = [line.split("|")[1:3] for line in table.splitlines()[2:]]
  listed = {extra.strip().strip("`"): {p.strip().strip("`") for p in adds.split(",")}
            for extra, adds in rows}
  declared = {extra: {_name(r) for r in reqs}
              for extra, reqs in _project()["optional-dependencies"].items()}
  assert listed == declared


def test_one_jax_range_everywhere():
  """pyproject (jax, jaxlib, the cuda extra) and the README name one range;
  both CI stacks lie in it."""
  want = ">=0.11.2,<0.13"
  deps = _project()["dependencies"]
  assert f"jax{want}" in deps and f"jaxlib{want}" in deps
  assert _project()["optional-dependencies"]["cuda"] == [f"jax[cuda13]{want}"]
  assert f"`jax{want}`" in (ROOT / "README.md").read_text()
  for name, version in (("constraints.txt", "0.11.2"),
                        ("constraints-jax012.txt", "0.12.0.1")):
    pins = (ROOT / name).read_text().splitlines()
    assert f"jax=={version}" in pins and f"jaxlib=={version}" in pins, name


def test_ci_runs_both_tiers_and_fails_on_either():
  """``set -e``, no ``|| true``, no ``exec`` before the second tier: a
  failing tier (pytest's exit code 5, nothing collected, included) fails
  the run."""
  lines = [line for line in (ROOT / ".ci" / "run").read_text().splitlines()
           if line and not line.startswith("#")]
  assert "set -euo pipefail" in lines
  assert lines[-2:] == ["scripts/dev test -q", "scripts/dev compat -q"]
  assert not any("||" in line or line.startswith("exec") for line in lines)


def test_compat_tests_name_existing_tests():
  """Each of ``conftest.COMPAT_TESTS`` names a test function of its file (a
  renamed test would silently leave the compatibility tier)."""
  for nodeid in COMPAT_TESTS:
    path, _, test = nodeid.partition("::")
    assert f"\ndef {test.split('[')[0]}(" in (ROOT / path).read_text(), nodeid


def test_kept_compile_cache_is_trimmed_oldest_first(tmp_path):
  """``scripts/dev test``'s kept cache holds at most its limit after a run
  starts: the least recently written files go first (tests/conftest.py
  trims it once a run instead of JAX's scan on every write)."""
  from helpers.cache_trim import trim_cache
  for age, name in enumerate(("newest", "middle", "oldest-atime", "oldest")):
    path = tmp_path / name
    path.write_bytes(b"x" * 100)
    os.utime(path, ns=(10**18 - age * 10**9,) * 2)
  assert trim_cache(tmp_path, 250) == ["oldest", "oldest-atime"]
  assert sorted(p.name for p in tmp_path.iterdir()) == ["middle", "newest"]
  assert trim_cache(tmp_path, 250) == []
  assert trim_cache(tmp_path / "absent", 0) == []
