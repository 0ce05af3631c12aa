#!/usr/bin/env bash
# Per-kernel profiles of the truncated sampler for several settings of
# jaxsample.pallas.threshold's module knobs, one profile per argument word:
#   bash scripts/sweep_knobs.sh B "_COMPACT_BLOCK=512,_COMPACT_TILE=4 _COMPACT_SPLIT_FACTOR=2"
# ("-" alone: the defaults).  Run from the repo root on the GPU machine;
# SETTINGS/MASK_IDS/TOP/FLAT as for scripts/profile_truncation.py.
# (It replaces scripts/sweep_compact.sh, whose "chunk,tile,warps" triples set
# _COMPACT_BLOCK, _COMPACT_TILE and _COMPACT_WARPS.)
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
batch="$1"; shift
for knobs in $1; do
  echo "#### knobs $knobs"
  [[ "$knobs" == "-" ]] && knobs=""
  python3 scripts/profile_truncation.py "$batch" float32 ${knobs//,/ } 2>&1 |
    grep -v "Warn\|warn"
done
