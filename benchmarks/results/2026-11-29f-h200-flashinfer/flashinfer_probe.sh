#!/usr/bin/env bash
# One-minute probe of the GPU machine for the FlashInfer peer's build (issue 49, point 5):
# nvcc, ninja, torch's extension loader, the GPU's compute capability, the source copy.
# Run from the repo root: bash /work/scratch/flashinfer_probe.sh  (or its copy in the tree)
set -u
echo "== nvcc"; (nvcc --version || ls /usr/local/cuda*/bin/nvcc) 2>&1 | tail -3
echo "== which ninja"; which ninja; ninja --version 2>&1
echo "== python3"; python3 - <<'PY'
import importlib.util, sys
print(sys.version.split()[0])
for name in ("torch", "ninja", "triton", "jax"):
    print(f"{name}: {'importable' if importlib.util.find_spec(name) else 'MISSING'}")
import torch
from torch.utils import cpp_extension
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
print("cpp_extension.is_ninja_available():", cpp_extension.is_ninja_available())
print("CUDA_HOME:", cpp_extension.CUDA_HOME)
if torch.cuda.is_available():
    print("device:", torch.cuda.get_device_name(), "capability:", torch.cuda.get_device_capability())
PY
echo "== source copy"; ls -la .peers/flashinfer .peers/flashinfer/include/flashinfer 2>&1; cat .peers/flashinfer/COMMIT 2>&1
