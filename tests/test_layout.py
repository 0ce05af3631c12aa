"""The package's layout: every module imports alone, imports form no cycle,
no import hides inside a function, backends never import the public API and
every public module declares ``__all__`` (the README's layout table:
``test_readme.py``); the tests mirror the layers (docs/testing.md,
"Layout")."""

import ast
import inspect
import os
import pathlib
import subprocess
import sys

from jaxsample._src import backends
from jaxsample._src.params import IMPLEMENTATIONS

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "jaxsample"
# The public API: entry points that validate, canonicalize and dispatch.
PUBLIC_API = {"jaxsample", "jaxsample._src.sampling", "jaxsample._src.mask",
              "jaxsample._src.spec", "jaxsample._src.parallel.vocab"}
# The public modules: faces that only hand on names of the private core.
PUBLIC_FACES = {"jaxsample.logprobs", "jaxsample.processors",
                "jaxsample.sharded", "jaxsample.tuning"}
# Layers built on the public API (no sampler module imports them): the
# decode and serving loops, and the applications (text generation from
# checkpoints and its command line among them).
APPS = ("jaxsample.bench", "jaxsample.demo", "jaxsample.generation",
        "jaxsample.serve_loop", "jaxsample.serve_demo",
        "jaxsample.models.text", "jaxsample.generate")


# Kernels and their thin wrappers; the API modules that validate and call
# one backend (``jaxsample._src.backends``); the module through which the
# API reaches the kernels: the Pallas backend (the vocab-parallel race
# included: ``race_vocab_shard``).
KERNELS = "jaxsample._src.pallas"
BACKEND_API = ("jaxsample._src.sampling", "jaxsample._src.mask",
               "jaxsample._src.spec")
KERNEL_GATES = {"jaxsample._src.backends.pallas"}


def in_package(name: str, package: str) -> bool:
  return name == package or name.startswith(package + ".")


def is_app(name: str) -> bool:
  return any(name == app or name.startswith(app + ".") for app in APPS)


def module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(ROOT).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imported_modules(name: str, tree: ast.Module) -> set[str]:
  """The package modules ``tree`` imports: for ``from a import b``, ``a.b``
  where it is a module, else ``a``."""
  found = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      found |= {a.name for a in node.names}
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:  # relative: resolve against this module's package
        package = name if MODULES[name].name == "__init__.py" else (
            name.rpartition(".")[0])
        parts = package.split(".")[:len(package.split(".")) - node.level + 1]
        base = ".".join(parts + ([node.module] if node.module else []))
      found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base
                for a in node.names}
  return {m for m in found if m in MODULES}


GRAPH = {name: imported_modules(name, ast.parse(path.read_text()))
         for name, path in MODULES.items()}


def test_tree_is_found():
  assert {"jaxsample", "jaxsample._src.sampling", "jaxsample._src.pallas.gumbel",
          "jaxsample._src.pallas.threshold.route"} <= set(MODULES)


def third_party_imports() -> set[str]:
  """Every module outside the package that a package module imports (and
  the names its ``from`` imports take, which may be submodules)."""
  found = set()
  for path in MODULES.values():
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Import):
        found |= {a.name for a in node.names}
      elif isinstance(node, ast.ImportFrom) and not node.level:
        # (``from a import b``: ``b`` may be a submodule; the child tries.)
        found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
  return {m for m in found if m.partition(".")[0] not in ("jaxsample",
                                                          "__future__")}


# Imports once what every child would otherwise import or compile again: the
# third-party modules the package uses (JAX, flax, matplotlib ...: optional
# ones may be absent), the MLIR dialects JAX loads at its first lowering (a
# module-level jnp array lowers), and the package's bytecode, compiled (not
# run) into a temporary ``sys.pycache_prefix``; freezes the heap so that no
# child's garbage collector walks (and copies) the parent's objects. Then
# imports each module in a forked child with no jaxsample module loaded: the
# module alone, as a fresh interpreter would.
_IMPORT_EACH_ALONE = """
import gc, importlib, importlib.util, os, pathlib, py_compile, shutil, sys
import tempfile, traceback
third_party, names = sys.argv[1].split(","), sys.argv[2:]
for name in third_party + ["jaxlib.mlir.dialects.mhlo"]:
  try:
    importlib.import_module(name)
  except ImportError:
    pass
sys.pycache_prefix = tempfile.mkdtemp(prefix="jaxsample-layout-pyc-")
for source in pathlib.Path("jaxsample").resolve().rglob("*.py"):
  py_compile.compile(str(source), importlib.util.cache_from_source(source),
                     doraise=True)
gc.freeze()
assert not any(m.startswith("jaxsample") for m in sys.modules)
failed = []
for name in names:
  pid = os.fork()
  if pid == 0:
    try:
      importlib.import_module(name)
    except BaseException:
      traceback.print_exc()
      os._exit(1)
    os._exit(0)
  if os.waitpid(pid, 0)[1]:
    failed.append(name)
shutil.rmtree(sys.pycache_prefix)
print("FAILED", failed)
sys.exit(1 if failed else 0)
"""


def test_every_module_imports_alone():
  """Each module imports with no other jaxsample module loaded first (no
  order dependence; ``__main__`` modules run when imported)."""
  names = [name for name in sorted(MODULES) if not name.endswith(".__main__")]
  done = subprocess.run([sys.executable, "-c", _IMPORT_EACH_ALONE,
                         ",".join(sorted(third_party_imports())), *names],
                        cwd=ROOT, capture_output=True, text=True, timeout=600,
                        env=dict(os.environ, JAX_PLATFORMS="cpu",
                                 PYTHONPATH=str(ROOT)))
  assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-6000:]
  assert "FAILED []" in done.stdout


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
  """A cycle of ``graph`` as a path ``[a, ..., a]``, or None."""
  state = {}  # 1: on the stack, 2: done

  def visit(node, path):
    state[node] = 1
    for succ in sorted(graph[node]):
      if state.get(succ) == 1:
        return path[path.index(succ):] + [succ]
      if succ not in state:
        cycle = visit(succ, path + [succ])
        if cycle:
          return cycle
    state[node] = 2
    return None

  for node in sorted(graph):
    if node not in state:
      cycle = visit(node, [node])
      if cycle:
        return cycle
  return None


def test_find_cycle_finds_cycles():
  assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [
      "a", "b", "c", "a"]
  assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_no_import_cycle():
  assert find_cycle(GRAPH) is None


def test_no_import_inside_a_function():
  found = []
  for name, path in MODULES.items():
    for func in ast.walk(ast.parse(path.read_text())):
      if isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
        found += [f"{name}:{node.lineno}" for node in ast.walk(func)
                  if isinstance(node, (ast.Import, ast.ImportFrom))]
  assert not found


def test_backends_do_not_import_the_public_api():
  """Only the public modules (and applications) import the public API; the
  reference, the shared helpers and the Pallas routes sit below it."""
  found = {name: GRAPH[name] & PUBLIC_API for name in MODULES
           if name not in PUBLIC_API | PUBLIC_FACES and not is_app(name)}
  assert not {name: deps for name, deps in found.items() if deps}


def test_nothing_in_the_package_imports_an_application():
  assert not {name: deps for name, deps in GRAPH.items()
              if not is_app(name) and any(is_app(d) for d in deps)}


def test_only_the_bench_imports_the_bench():
  """Benchmarks are a leaf: no product or demo module imports them."""
  bench = lambda m: m == "jaxsample.bench" or m.startswith("jaxsample.bench.")
  assert not {name: deps for name, deps in GRAPH.items()
              if not bench(name) and any(bench(d) for d in deps)}


def test_every_public_module_declares_all():
  missing = []
  for name, path in MODULES.items():
    if is_app(name) or name.rpartition(".")[2].startswith("_"):
      continue
    targets = [t for node in ast.parse(path.read_text()).body
               for t in (node.targets if isinstance(node, ast.Assign) else
                         [node.target] if isinstance(node, ast.AnnAssign)
                         else [])]
    if not any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
      missing.append(name)
  assert not missing


def test_public_face_is_the_api_only():
  """A fresh ``import jaxsample`` shows ``__all__`` and the public modules,
  and no internal module (those live under the private ``jaxsample._src``)."""
  code = ("import jaxsample; print(' '.join(sorted(n for n in dir(jaxsample)"
          " if not n.startswith('_')))); print(' '.join(jaxsample.__all__))")
  shown, api = subprocess.run(
      [sys.executable, "-c", code], capture_output=True, text=True, check=True,
      cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}).stdout.splitlines()
  faces = {name.rpartition(".")[2] for name in PUBLIC_FACES}
  assert set(shown.split()) == set(api.split()) | faces


# ---------------------------------------------------------------------------
# The tests' layout (docs/testing.md, "Layout").
# ---------------------------------------------------------------------------

TESTS = ROOT / "tests"


def private_uses(tree: ast.Module) -> set[str]:
  """Private names a file takes from jaxsample: ``from jaxsample.x import
  _name`` and ``module._name`` on a name bound by a jaxsample import (the
  private package ``_src`` is where stage-level modules live: allowed)."""
  bound, found = set(), set()
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jaxsample"):
      bound |= {a.asname or a.name for a in node.names}
      found |= {a.name for a in node.names if a.name.startswith("_")}
    elif isinstance(node, ast.Import):
      bound |= {a.asname or a.name.partition(".")[0] for a in node.names
                if a.name.startswith("jaxsample")}
  for node in ast.walk(tree):
    chain, value = [], node
    while isinstance(value, ast.Attribute):
      chain.append(value.attr)
      value = value.value
    if isinstance(value, ast.Name) and value.id in bound:
      found |= {attr for attr in chain if attr.startswith("_") and
                not attr.startswith("__") and attr != "_src"}
  return found


def test_tests_mirror_the_layers():
  """conftest.py defines hooks, fixtures and private set-up only; no test
  file imports another or takes a private name from jaxsample; no file is a
  GPU twin of another (GPU tests live in their behaviour files)."""
  conftest = ast.parse((TESTS / "conftest.py").read_text())
  for node in conftest.body:
    if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
      fixture = any("fixture" in ast.unparse(d) for d in node.decorator_list)
      assert fixture or node.name.startswith("pytest_"), node.name
  assert not list(TESTS.glob("test_gpu*.py"))
  for path in sorted(TESTS.rglob("*.py")):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
      if isinstance(node, ast.ImportFrom):
        assert not (node.module or "").startswith("test_"), path.name
    assert not private_uses(tree), (path.name, private_uses(tree))


def test_kernels_import_nothing_above_them():
  """``pallas/`` holds kernels and their wrappers: its modules import each
  other and the shared core below the API (params, tuning, rng, processors,
  the reference math), never the API, the backends, the XLA search, the
  batch or vocab routes or ``dispatch``."""
  core = {"jaxsample._src." + m for m in (
      "params", "processors", "reference", "rng", "rowwise", "spec_reference",
      "tuning")}
  above = {name: sorted(d for d in deps
                        if not in_package(d, KERNELS) and d not in core)
           for name, deps in GRAPH.items() if in_package(name, KERNELS)}
  assert not {name: deps for name, deps in above.items() if deps}


def kernel_paths(name: str, seen: set[str]) -> list[list[str]]:
  """Import paths from ``name`` to a kernel module that pass no module of
  ``KERNEL_GATES``."""
  if name in KERNEL_GATES or name in seen:
    return []
  seen.add(name)
  if in_package(name, KERNELS):
    return [[name]]
  return [[name] + path for dep in sorted(GRAPH[name])
          for path in kernel_paths(dep, seen)]


def test_kernel_paths_finds_ungated_paths():
  assert kernel_paths("jaxsample._src.backends.pallas", set()) == []
  assert kernel_paths("jaxsample._src.backends", set()) == []
  assert kernel_paths("jaxsample._src.pallas.gumbel", set())[0] == [
      "jaxsample._src.pallas.gumbel"]


def test_the_api_reaches_kernels_only_through_backends():
  """``sample``, ``extract_sampling_mask`` and ``rejection_sample`` import no
  kernel module, and every import path from them to one passes a kernel
  gate (``KERNEL_GATES``)."""
  for api in BACKEND_API:
    assert not {d for d in GRAPH[api] if in_package(d, KERNELS)}, api
    assert not kernel_paths(api, set()), api


def test_params_and_generation_import_no_kernels():
  """The params and the generation layer sit beside the kernels, not on
  them (their launch settings: ``jaxsample._src.tuning``)."""
  users = [name for name in MODULES if name == "jaxsample._src.params" or
           in_package(name, "jaxsample.generation")]
  assert not {name: GRAPH[name] for name in users
              if any(in_package(d, KERNELS) for d in GRAPH[name])}


def test_every_backend_defines_the_same_entry_points():
  """The backend table holds every backend module, one per implementation
  name, each defining every entry point with the same parameters."""
  modules = {name for name in MODULES
             if name.startswith("jaxsample._src.backends.")}
  assert {m.__name__ for m in backends.BACKENDS.values()} == modules
  assert set(backends.BACKENDS) == set(IMPLEMENTATIONS) - {"auto"}
  for entry in backends.ENTRY_POINTS:
    parameters = {name: tuple(inspect.signature(getattr(module, entry))
                              .parameters)
                  for name, module in backends.BACKENDS.items()}
    assert len(set(parameters.values())) == 1, (entry, parameters)
