#!/usr/bin/env bash
# Session 14, call 4 (H200, ~2 min): check_fast_accum_engine.py again after 694728e (call 3's
# run compared one trace with itself: the FP8 GEMMs' module-level jit reused the first
# engine's traces for the other settings).
#   OUT=... bash scripts/gpu_call_s14_fa_logits.sh   (limit 200 s)
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
TAIL=16 run fa-logits 170 python3 -u benchmarks/kernels/check_fast_accum_engine.py \
  --out "$OUT/records/fast_accum"
