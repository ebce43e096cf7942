#!/usr/bin/env bash
# Session 21, call 4 (H200, limit 400 s): 16-bit KV decode at head dim 256, never tuned at
# Gemma 3's 4/1/256 (Triton 3.6 statically: the bf16 default at 254 registers, 2 programs an
# SM). Stock beside ours; candidates 32-token steps, 8 warps, 3 stages; device checks first.
#   OUT=... bash scripts/gpu_call_s21_c.sh
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
PSB="python3 -u benchmarks/kernels/bench_paged_small_batch.py"
TUNES=bt32,w8,bt32w8,s3,bt128w8
TAIL=14 run g4-bf16 190 $PSB --deadline-s 175 --heads 4/1/256 --checks 4x2048,32x2048 \
  --tunes $TUNES --points 1x2048,4x2048,16x2048,64x2048,128x2048,16x8192 \
  --out "$OUT/records/g4_bf16"
TAIL=14 run d256-bf16 150 $PSB --deadline-s 135 --no-checks --heads 16/8/256 --tunes $TUNES \
  --points 4x2048,16x2048,64x2048,128x2048 --out "$OUT/records/d256_bf16"
