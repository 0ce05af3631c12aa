#!/usr/bin/env bash
# Per-kernel profiles of the truncated sampler for several compact-pass plans
# (chunk, chunks per step, warps): bash scripts/sweep_compact.sh B "C,T,W ..."
# (run from the repo root on the GPU machine; SETTINGS/MASK_IDS/TOP/FLAT as
# for scripts/profile_truncation.py).
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
batch="$1"; shift
for plan in $1; do
  IFS=, read -r chunk tile warps <<< "$plan"
  echo "#### compact plan chunk=$chunk tile=$tile warps=$warps"
  python3 scripts/profile_truncation.py "$batch" float32 _COMPACT_BLOCK="$chunk" \
    _COMPACT_TILE="$tile" _COMPACT_WARPS="$warps" 2>&1 | grep -v "Warn\|warn"
done
