"""Every kernel states its GPU backend: each ``pallas_call`` passes Triton
compiler parameters, so a JAX whose default GPU backend changes cannot
silently move a kernel off Triton (``docs/lowering.md``)."""

import ast
import pathlib

from jax.experimental.pallas import triton as plgpu

from jaxsample._src.pallas import common

ROOT = pathlib.Path(__file__).resolve().parent.parent


def pallas_calls():
  """``(where, call)`` of every ``pallas_call(...)`` in the package but the
  one inside ``pallas.common.pallas_call`` (the kernels' wrapper, which
  passes its callers' ``compiler_params`` on and checks their type)."""
  for path in sorted((ROOT / "jaxsample").rglob("*.py")):
    tree = ast.parse(path.read_text())
    wrapper = {id(node) for func in ast.walk(tree)
               if isinstance(func, ast.FunctionDef) and
               func.name == "pallas_call" for node in ast.walk(func)}
    for node in ast.walk(tree):
      if isinstance(node, ast.Call) and id(node) not in wrapper and (
          getattr(node.func, "attr", None) == "pallas_call" or
          getattr(node.func, "id", None) == "pallas_call"):
        yield f"{path.relative_to(ROOT)}:{node.lineno}", node


def states_triton_params(call: ast.Call) -> bool:
  """``compiler_params=plgpu.CompilerParams(num_warps=..., num_stages=...)``
  or ``compiler_params=<plan>.compiler_params()``."""
  value = next((k.value for k in call.keywords if k.arg == "compiler_params"),
               None)
  if not isinstance(value, ast.Call):
    return False
  func = ast.unparse(value.func)
  if func == "plgpu.CompilerParams":
    return {"num_warps", "num_stages"} <= {k.arg for k in value.keywords}
  return func.endswith(".compiler_params") and not value.args


def test_every_pallas_call_states_triton_compiler_params():
  calls = list(pallas_calls())
  assert len(calls) >= 10  # gumbel, 7 truncation kernels, 2 spec passes
  assert [where for where, call in calls if not states_triton_params(call)] == []


def test_the_check_rejects_calls_without_triton_params():
  call = lambda src: ast.parse(src).body[0].value
  assert not states_triton_params(call("pl.pallas_call(f, grid=(1,))"))
  assert not states_triton_params(call(
      "pl.pallas_call(f, compiler_params=plgpu.CompilerParams(num_warps=4))"))
  assert not states_triton_params(call(
      "pl.pallas_call(f, compiler_params=None)"))
  assert states_triton_params(call(
      "pl.pallas_call(f, compiler_params=plan.compiler_params())"))


def test_plan_compiler_params_are_triton_params():
  plan = common.KernelPlan(chunk=1024, tile=1024, num_splits=2, steps=3,
                           num_warps=8, num_stages=2, interpret=True)
  params = plan.compiler_params()
  assert type(params) is plgpu.CompilerParams
  assert (params.num_warps, params.num_stages) == (8, 2)
