#!/usr/bin/env bash
# Session 21, call 2 (H200, limit 330 s): FP8 KV decode at head dim 256 -- which options the
# kernel should take there. Call 1 (gpu_call_next_s21_b.sh) found the default (kq8_bt64_w2_*,
# 2 warps, 64 tokens a step) 10-30 % behind other options at D 256: 16/8/256 32-token steps
# (B16-64 ctx2048 45.9 / 72.2 / 123.7 / 150.9 vs 50.7 / 75.4 / 138.6 / 168.9 us); Gemma 3's
# 4/1/256 4 warps (B4 7.4 vs 10.7; B8 / B16 128 tokens and 4 warps 9.5 / 12.1 vs 13.5 / 16.2).
# Here both head shapes get the same candidates: 32-token steps with 2 / 4 warps, 4 warps,
# 128 tokens 4 warps, and no straight-line splits (u0: is the spill the unrolled pair?).
#   OUT=... bash scripts/gpu_call_s21_a.sh
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
PSB="python3 -u benchmarks/kernels/bench_paged_small_batch.py"
TUNES=bt32,bt32w4,w4,bt128w4,u0,bt32u0
TAIL=14 run psb-fp8-g4 150 $PSB --deadline-s 135 --no-checks --heads 4/1/256 --tunes $TUNES \
  --points fp8:1x2048,fp8:4x2048,fp8:8x2048,fp8:16x2048,fp8:32x2048,fp8:64x2048 \
  --out "$OUT/records/psb_fp8_g4"
TAIL=14 run psb-fp8-d256 150 $PSB --deadline-s 135 --no-checks --heads 16/8/256 --tunes $TUNES \
  --points fp8:1x2048,fp8:4x2048,fp8:8x2048,fp8:16x2048,fp8:32x2048,fp8:64x2048 \
  --out "$OUT/records/psb_fp8_d256"
