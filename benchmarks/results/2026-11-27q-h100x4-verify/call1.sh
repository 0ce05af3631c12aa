#!/bin/bash
# Call 1 (x4): GPU tier + proof35 | nocond | topn | report V=151936 fp32 (sample part)
source .gpujobs/lanes.sh
lane 0 tier 585 "GPU_TEST_WORKERS=12 bash scripts/gpu_run.sh alltests; [ -f .gpujobs/proof35.sh ] && timeout \$(( 580 - SECONDS )) bash .gpujobs/proof35.sh"
[ -f .gpujobs/nocond.sh ] && lane 1 nocond 585 "bash .gpujobs/nocond.sh"
[ -f .gpujobs/topn.sh ] && lane 2 topn 585 "bash .gpujobs/topn.sh"
lane 3 rep151936f32 585 "BENCH_ARGS='--quick --time-limit 480' bash scripts/gpu_run.sh report-151936-float32"
wait_lanes
