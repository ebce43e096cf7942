#!/usr/bin/env bash
# Next session (H200, limit 300 s; prepared in session 20, not run): FP8 KV at head dims 64
# and 256. The split rule from 16 rows (kq8_bt64_w2_waves) assumes 528 slots (4 programs an
# SM, measured at D 128); Triton 3.6's static analysis (record
# paged_decode_static_heads_s20-20261204.json) gives kq8_bt64_w2 8 programs an SM at D 64 (26
# KB, 111 registers) and 2 at D 256 (102 KB, 255 registers and 9 spills). Times the default
# against the slots those counts imply (ws1056 at D 64, ws264 at D 256) and, at D 256, the
# variant at 32-token steps and 4 warps (fewer registers a thread), stock-free (FP8).
#   OUT=... bash scripts/gpu_call_next_s21_b.sh
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
PSB="python3 -u benchmarks/kernels/bench_paged_small_batch.py"
TAIL=12 run psb-fp8-d256 130 $PSB --deadline-s 115 --no-checks --heads 16/8/256 \
  --tunes ws264,bt32,w4,bt32w4 --points fp8:16x2048,fp8:24x2048,fp8:48x2048,fp8:64x2048 \
  --out "$OUT/records/psb_fp8_d256"
TAIL=12 run psb-fp8-d64 100 $PSB --deadline-s 85 --no-checks --heads 32/8/64 \
  --tunes ws1056 --points fp8:16x2048,fp8:24x2048,fp8:48x2048,fp8:64x2048 \
  --out "$OUT/records/psb_fp8_d64"
