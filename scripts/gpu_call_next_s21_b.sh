#!/usr/bin/env bash
# Next session (H200, limit 340 s; prepared in session 20, not run): FP8 KV at head dims 64
# and 256. The split rule from 16 rows (kq8_bt64_w2_waves) assumes 528 slots (4 programs an
# SM, measured at D 128); Triton 3.6's static analysis (record
# paged_decode_static_heads_s20-20261204.json) gives kq8_bt64_w2 8 programs an SM at D 64 (26
# KB, 111 registers) and 2 at D 256 (102 KB, 255 registers and 9 spills). Times the default
# against the slots those counts imply (ws1056 at D 64, ws264 at D 256) and, at D 256, the
# variant with 4 warps (kq8_bt64 at 64-token steps, kq8 at 128: no spills statically) and at
# 32-token steps. Gemma 3 1B-like heads (4/1/256): kq8_bt64_w2 spills 129 registers there.
#   OUT=... bash scripts/gpu_call_next_s21_b.sh
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
PSB="python3 -u benchmarks/kernels/bench_paged_small_batch.py"
TAIL=12 run psb-fp8-d256 130 $PSB --deadline-s 115 --no-checks --heads 16/8/256 \
  --tunes ws264,w4,bt128w4,bt32 --points fp8:16x2048,fp8:24x2048,fp8:48x2048,fp8:64x2048 \
  --out "$OUT/records/psb_fp8_d256"
TAIL=12 run psb-fp8-d64 100 $PSB --deadline-s 85 --no-checks --heads 32/8/64 \
  --tunes ws1056 --points fp8:16x2048,fp8:24x2048,fp8:48x2048,fp8:64x2048 \
  --out "$OUT/records/psb_fp8_d64"
TAIL=12 run psb-fp8-g4 90 $PSB --deadline-s 75 --no-checks --heads 4/1/256 \
  --tunes w4,bt128w4 --points fp8:4x2048,fp8:8x2048,fp8:16x2048,fp8:32x2048 \
  --out "$OUT/records/psb_fp8_g4"
