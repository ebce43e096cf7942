#!/usr/bin/env bash
# Next session (H200, limit ~330 s; prepared in session 21, not run): paged decode at SmolLM2's
# geometry (9 q heads over 3 KV heads, D 64: the default model of `jaxinfer chat`), never
# timed on the GPU. bf16 with stock beside, then FP8; candidate launches as in session 21's
# head-dim-256 calls (32 / 128-token steps, 8 / 2 warps), device checks first.
#   OUT=... bash scripts/gpu_call_next_s22_b.sh
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
PSB="python3 -u benchmarks/kernels/bench_paged_small_batch.py"
TAIL=14 run smol-bf16 160 $PSB --deadline-s 145 --heads 9/3/64 --checks 1x2048,16x2048,fp8:16x2048 \
  --tunes bt32,bt128,w8,w2 --points 1x2048,4x2048,16x2048,64x2048,128x2048 \
  --out "$OUT/records/smol_bf16"
TAIL=14 run smol-fp8 140 $PSB --deadline-s 125 --no-checks --heads 9/3/64 --tunes bt32,w4,bt128w4 \
  --points fp8:1x2048,fp8:4x2048,fp8:16x2048,fp8:64x2048,fp8:128x2048 \
  --out "$OUT/records/smol_fp8"
