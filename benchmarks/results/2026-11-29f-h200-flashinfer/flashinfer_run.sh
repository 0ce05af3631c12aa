#!/usr/bin/env bash
# FlashInfer's sampling kernels beside jaxsample on the GPU machine (issue 49, point 5).
# From the repo root, with FlashInfer's source copy at .peers/flashinfer (carried):
#   bash .peers/flashinfer/flashinfer_run.sh        (a copy of /work/scratch/flashinfer_run.sh)
# 1. builds jaxsample's binding against the copy (into /tmp/jaxsample-flashinfer-smXY; prints the time),
# 2. runs the FlashInfer GPU tests of tests/test_gpu_peers.py (the report test: gpu_run.sh peers),
# 3. times FlashInfer (plain, top-k 50 + top-p 0.9 both paths, top-p 0.95 / 0.9, min-p 0.1)
#    beside jaxsample.sample (params traced) and jnp.max at V = 151936 fp32,
#    B = 1, 32, 128, 256, T = 0.7, randn rows; prints a table; JSON + logs under $OUT.
# Environment: BATCH, SETTINGS, DIST, ITERS, REPEATS override the grid.
set -u
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
export JAXSAMPLE_FLASHINFER_SRC=${JAXSAMPLE_FLASHINFER_SRC:-.peers/flashinfer}
OUT=${OUT:-/tmp/flashinfer-out}; mkdir -p "$OUT"
status=0
echo "== $(date -u +%T) build (nvcc $(nvcc --version | grep -o 'release [0-9.]*'))"
timeout 420 python3 - > "$OUT/build.log" 2>&1 <<'PY'
from jaxsample.bench import flashinfer_peers
kernels = flashinfer_peers.load(verbose=True)  # into /tmp/jaxsample-flashinfer-sm90
print(f"BUILD OK in {kernels.build_s:.1f} s: {kernels.describe()}")
PY
rc=$?; tail -n 25 "$OUT/build.log"; [[ $rc -ne 0 ]] && { echo "BUILD FAILED (rc $rc)"; exit 1; }
echo "== $(date -u +%T) gpu tests"
timeout 240 python3 -m pytest -m gpu -q -rfEs -p no:cacheprovider \
  tests/test_flashinfer_peer.py -k "not report" > "$OUT/gpu-tests.log" 2>&1
rc=$?; status=$((status | rc)); tail -n 25 "$OUT/gpu-tests.log"
echo "== $(date -u +%T) timing"
timeout 300 python3 - "$OUT/flashinfer-timing.json" 2>&1 <<'PY' | tee "$OUT/timing.log"
import os, sys
from jaxsample.bench import cli, flashinfer_peers, runner, suites
from jaxsample.bench.timing import measure_bandwidth
env = os.environ.get
parser = cli.parser()
args = parser.parse_args([
    "sample", "--batch", env("BATCH", "1,32,128,256"), "--vocab", "151936",
    "--dtypes", "float32", "--dists", env("DIST", "randn"), "--temperature", "0.7",
    "--settings", env("SETTINGS", "plain,top_k50+top_p0.9,top_p0.95,top_p0.9,min_p0.1"),
    "--params", "arg", "--no-reference", "--ops", "jaxsample,jnp.max,flashinfer",
    "--iters", env("ITERS", "16"), "--repeats", env("REPEATS", "3"), "--no-progress"])
kernels = flashinfer_peers.load()  # the build above: ninja finds it up to date
external = flashinfer_peers.peer_factories(kernels)
bandwidth = measure_bandwidth(1.0)
runner.print_header("flashinfer beside jaxsample", bandwidth)
rows = []
for case in suites.SAMPLE.cases(args):
  group = suites.SAMPLE.build(args, case)
  group.suite = "sample"
  rows += runner.time_group(group, args, bandwidth, external=external)
  del group
cols = ["jaxsample", "jnp.max (one read)", flashinfer_peers.SAMPLER, flashinfer_peers.JOINT]
at = {(r["setting"], r["batch"], r["op"]): r["us"] for r in rows}
print(f"\n# device us per call, V = 151936 fp32, T = 0.7, {args.dists} rows; FlashInfer "
      f"{kernels.commit}; x = FlashInfer sampling / jaxsample")
print("| setting | B | " + " | ".join(cols) + " | x |\n|---|---|" + "---|" * (len(cols) + 1))
for setting in dict.fromkeys(r["setting"] for r in rows):
  for batch in sorted({r["batch"] for r in rows if r["setting"] == setting}):
    got = [at.get((setting, batch, c)) for c in cols]
    ratio = f"{got[2] / got[0]:.2f}" if got[0] and got[2] else "-"
    print(f"| {setting} | {batch} | " + " | ".join(f"{u:.1f}" if u else "-" for u in got)
          + f" | {ratio} |")
runner.write_json(dict(suite="flashinfer", **runner.describe_device(bandwidth),
                       flashinfer=kernels.describe(), options=vars(args), rows=rows),
                  sys.argv[1])
print(f"# {len(rows)} rows -> {sys.argv[1]}")
PY
rc=${PIPESTATUS[0]}; status=$((status | rc))
echo "== $(date -u +%T) done, status $status"
exit $status
