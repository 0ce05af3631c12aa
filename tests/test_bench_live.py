"""Benchmarks time every kernel they name: no timed function drops a Pallas
kernel's outputs (JAX >= 0.12 removes such a call as dead code, and the
benchmark would time nothing).  Tracing only: nothing here compiles."""

import jax
import jax.numpy as jnp
import pytest

import jaxsample as js
from jaxsample.bench import cli, timing

from jaxsample.bench import suites

pytestmark = pytest.mark.compat  # jax 0.12 removes dead kernels: check there too

B, V = 2, 256
PLAIN = js.SamplingParams.make(B, temperature=0.8)
PALLAS = js.SamplerConfig(implementation="pallas")
KEY = jax.random.key(0)


def _sample(x):
  return js.sample(x, PLAIN, KEY, config=PALLAS)


def test_kernel_calls_finds_dropped_outputs():
  x = jnp.zeros((B, V))
  live, dead = timing.kernel_calls(_sample, x)
  assert live >= 1 and dead == 0
  # Dropped: directly, behind jit, and inside one branch of a cond.
  assert timing.kernel_calls(lambda x: (_sample(x), x)[1], x) == (0, live)
  assert timing.kernel_calls(
      lambda x: (jax.jit(_sample)(x), x)[1], x) == (0, live)

  def one_branch_drops(x, which):
    return jax.lax.cond(which, lambda x: _sample(x).tokens,
                        lambda x: (_sample(x), x[:, 0].astype(jnp.int32))[1],
                        x)
  assert timing.kernel_calls(one_branch_drops, x, True) == (live, live)


def test_time_op_refuses_a_function_that_drops_kernel_outputs():
  with pytest.raises(ValueError, match="dead code"):
    timing.time_op(lambda x: (_sample(x), x)[1], [jnp.zeros((B, V))], 1, 1)


def test_the_sample_suites_sampler_keeps_its_kernels():
  """``sampler`` (the sample, truncation, profile, fp64 and sweep suites'
  op) returns the whole result, the mask included."""
  x = jnp.zeros((B, V))
  params = js.SamplingParams.make(B, temperature=0.8, min_p=0.05)
  live, dead = timing.kernel_calls(
      suites.sampler(params, mask_cap=8, implementation="pallas"), x)
  assert live > 1 and dead == 0


# Per suite: options that give its kernel ops (the pallas implementation);
# the suites that run their ops while building (sample, extract) are left
# to the test above: building them compiles.
SUITE_ARGS = {
    "spec": ["--k", "2", "--rates", "0.5"],
    "pivot": [],
}


@pytest.mark.parametrize("suite", sorted(SUITE_ARGS))
def test_suites_time_live_kernels(suite):
  """Every op of a suite's first tiny case keeps all its kernels live, and
  the jaxsample ops call some."""
  args = cli.parser().parse_args(
      [suite, "--batch", str(B), "--vocab", str(V), "--dtypes", "float32",
       "--implementation", "pallas", *SUITE_ARGS[suite]])
  spec = cli.SUITES[suite]
  group = spec.build(args, spec.cases(args)[0])
  for name, fn in group.ops.items():
    live, dead = timing.kernel_calls(fn, group.inputs[0])
    assert dead == 0, (suite, name, live, dead)
    if name.startswith(("jaxsample", "pivot")) and "xla" not in name:
      assert live > 0, (suite, name)
