#!/bin/bash
# Call 2 (x4): report sample parts V=151936 fp32 (again) and bf16, V=128256 fp32 | spec parts V=151936
source .gpujobs/lanes.sh
lane 0 rep151936f32 585 "BENCH_ARGS='--quick --time-limit 470' bash scripts/gpu_run.sh report-151936-float32"
lane 1 rep151936bf16 585 "BENCH_ARGS='--quick --time-limit 470' bash scripts/gpu_run.sh report-151936-bfloat16"
lane 2 rep128256f32 585 "BENCH_ARGS='--quick --time-limit 470' bash scripts/gpu_run.sh report-128256-float32"
lane 3 spec151936 585 "BENCH_ARGS='--iters 4 --repeats 2 --bandwidth-gib 0.25 --spec-k 1,4,8 --time-limit 240' bash scripts/gpu_run.sh reportspec-151936-float32 reportspec-151936-bfloat16"
wait_lanes
