#!/usr/bin/env bash
# Session 19, call 5 (H200, ~4 min): the engine end to end with the new FP8-KV decode default
# (kq8_bt64_w2 split to ~4 programs an SM from 4 rows; was cvt at 8-63 rows): 8B bf16 weights,
# FP8 KV cache, batch 32, ctx 2048, against the old by-batch table (--patch) in a second
# process; the device pace (back-to-back replays) carries the A/B.
#   OUT=... bash scripts/gpu_call_s19_e.sh   (limit 290 s)
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
GD="python3 -u benchmarks/gpu_decode.py --backends pallas::fp8 --batches 32 --ctx 2048 --steps 32 --quick"
TAIL=8 run e2e-kvnew 130 $GD --budget-s 115 --out "$OUT/records/e2e_kvnew"
TAIL=8 run e2e-kvold 130 $GD --budget-s 115 \
  --patch "pallas_kernels.paged_attention.fp8.FP8_DECODE_BY_BATCH=((64,'kq8_bt64_w2'),(8,'cvt'),(1,'kq8'))" \
  --out "$OUT/records/e2e_kvold"
