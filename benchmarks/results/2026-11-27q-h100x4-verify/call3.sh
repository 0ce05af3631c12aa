#!/bin/bash
# Call 3 (x4): the 2-GPU file and 2 processes, then main-fp32 | report V=128256 bf16 | spec parts V=128256
source .gpujobs/lanes.sh
lane 0,1 multigpu 530 "bash scripts/gpu_run.sh multigpu; CUDA_VISIBLE_DEVICES=0 timeout \$(( 520 - SECONDS )) bash scripts/gpu_run.sh main-fp32"
lane 2 rep128256bf16 530 "BENCH_ARGS='--quick --time-limit 430' bash scripts/gpu_run.sh report-128256-bfloat16"
lane 3 spec128256 530 "BENCH_ARGS='--iters 4 --repeats 2 --bandwidth-gib 0.25 --spec-k 1,4,8 --time-limit 220' bash scripts/gpu_run.sh reportspec-128256-float32 reportspec-128256-bfloat16"
wait_lanes
