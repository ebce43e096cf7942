#!/usr/bin/env bash
# Session 20, call 3 (H200, limit 300 s): the engine end to end with the new FP8-KV table
# (split counts by wave efficiency from 16 rows): 8B bf16 weights, FP8 KV cache, a decode
# bucket of 48 rows, ctx 2048, against the old table (--patch) in a second process;
# the device pace (back-to-back replays) carries the A/B.
#   OUT=... bash scripts/gpu_call_s20_c.sh
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
GD="python3 -u benchmarks/gpu_decode.py --backends pallas::fp8 --batches 48 --ctx 2048 --steps 32 --quick"
TAIL=8 run e2e-waves 140 $GD --budget-s 125 --out "$OUT/records/e2e_waves"
TAIL=8 run e2e-old 140 $GD --budget-s 125 \
  --patch "pallas_kernels.paged_attention.fp8.FP8_DECODE_BY_BATCH=((64,'kq8_bt64_w2'),(4,'kq8_bt64_w2_tp512'),(1,'kq8'))" \
  --out "$OUT/records/e2e_old"
