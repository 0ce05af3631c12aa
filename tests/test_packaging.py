"""Packaging: the library declares ranges, the dev stack is pinned apart."""

import pathlib
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _pyproject():
  return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_library_requires_ranges_not_pins():
  deps = _pyproject()["project"]["dependencies"]
  assert deps, "no dependencies declared"
  for dep in deps:
    assert "==" not in dep, f"{dep}: installing jaxsample must not pin the user's stack"
  names = {d.split(">")[0].split("<")[0].split("=")[0].strip() for d in deps}
  assert {"jax", "jaxlib", "numpy"} <= names


def test_constraints_pin_the_gpu_machine_stack():
  pins = dict(line.split("==") for line in (ROOT / "constraints.txt").read_text().splitlines()
              if line and not line.startswith("#"))
  assert pins["jax"] == "0.11.2" and pins["jaxlib"] == "0.11.2" and pins["flax"] == "0.12.10"
  assert "constraints.txt" in (ROOT / "scripts" / "dev").read_text()


def test_license_typed_marker_and_changelog_ship():
  project = _pyproject()
  assert project["project"]["license"] == "Apache-2.0"
  assert "Apache License" in (ROOT / "LICENSE").read_text()
  assert (ROOT / "jaxsample" / "py.typed").exists()
  assert "py.typed" in project["tool"]["setuptools"]["package-data"]["jaxsample"]
  assert (ROOT / "CHANGELOG.md").read_text().startswith("# Changelog")
