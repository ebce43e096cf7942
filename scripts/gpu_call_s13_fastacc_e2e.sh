#!/usr/bin/env bash
# Session 13, call 5 (H200, ~4 min, the session's last device time): the 8B FP8 engine's
# decode with the FP8 dots on wgmma (fp8_plan.FP8_DECODE_FAST_ACCUM, the new default), batch
# 1 / 16 / 64, one process: compared with call 2's wave15 process (same tiles, mma.sync).
#   OUT=... bash scripts/gpu_call_s13_fastacc_e2e.sh   (limit 240 s)
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
TAIL=6 run e2e8-fastacc 190 python3 -u benchmarks/gpu_decode.py --quick --peer none \
  --backends pallas:fp8 --batches 1 16 64 --steps 32 --budget-s 170 \
  --out "$OUT/records/e2e8_fastacc"
