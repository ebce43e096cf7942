#!/usr/bin/env bash
# Session 14, call 3 (H200, ~6 min; the session's last device minutes):
# (1) the engine's logits with / without fast accum against XLA W8A16
#     (check_fast_accum_engine.py; call 1's greedy tokens on / off parted at token 1-17).
# (2) deep K steps (512 K, mma.sync) vs the 256-deep steps on wgmma the engine takes with
#     $JAXINFER_FP8_DECODE_DEEP_K=off, kernel alone, same run (call 2 had the 70B engine 4 %
#     faster end to end with them off): bench_matmul --plan deepk, one token.
#   OUT=... bash scripts/gpu_call_s14_deepk_kernel.sh   (limit 400 s)
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
TAIL=16 run fa-logits 200 python3 -u benchmarks/kernels/check_fast_accum_engine.py \
  --out "$OUT/records/fast_accum"
TAIL=24 run mm-deepk 130 python3 -u benchmarks/kernels/bench_matmul.py --plan deepk \
  --ms 1 --shapes 70b_up,70b_down,70b_o,8b_down --ceilings bw --compile-first \
  --budget 100 --out "$OUT/records/mm"
