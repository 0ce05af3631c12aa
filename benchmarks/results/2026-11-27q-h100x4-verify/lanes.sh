#!/bin/bash
# Sourced by callN.sh: lane GPUS NAME CAP_S CMD... runs CMD in the background on GPUS
# (CUDA_VISIBLE_DEVICES), output in $OUT/NAME.log, killed after CAP_S seconds; wait_lanes waits.
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
out="${OUT:-gpu-out}"; mkdir -p "$out"
{ date -u; nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader; } | tee "$out/env.log"
lane() {
  local gpus="$1" name="$2" cap="$3"; shift 3
  ( export CUDA_VISIBLE_DEVICES="$gpus" OUT="$out/$name"; mkdir -p "$OUT"
    s=$(date +%s); timeout "$cap" bash -c "$*" > "$out/$name.log" 2>&1; rc=$?
    echo "lane $name gpus=$gpus rc=$rc ${SECONDS}s $(( $(date +%s) - s ))s" >> "$out/lanes.txt" ) &
}
wait_lanes() {  # the device returns few files: one tarball of everything, and lanes.txt
  wait; cat "$out/lanes.txt"
  tar czf /tmp/lanes-all.tgz -C "$out" . && find "$out" -mindepth 1 ! -name lanes.txt -delete \
    && mv /tmp/lanes-all.tgz "$out/all.tgz"
}
