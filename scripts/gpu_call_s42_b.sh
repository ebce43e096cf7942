#!/usr/bin/env bash
# Session 42 call b (an H200 asked for; ~300 s on an H100, ~450 s on an H200 -- say which):
# 1. call a's switch-interval A/B again (modes in call a's order), with the benchmark's new
#    fields: the steps' wall time from the top-p request's arrival on, and the background
#    build's trace + lowering (the part that holds the GIL) and its whole build, so that the
#    cost of the finer switching to the build shows beside the shorter stall;
# 2. on an H200 only: session 34's FP8-KV decode sweep at 512 rows x 1,536 tokens.
#   OUT=... bash scripts/gpu_call_s42_b.sh
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/logs/nvidia-smi.txt"
if grep -q H200 "$OUT/logs/nvidia-smi.txt"; then
  TAIL=40 run fp8kv-b512 150 python3 -u benchmarks/kernels/bench_paged_fp8_sweep.py \
    --out "$OUT/records/b512" --shapes 512x1536,128x2048 --deadline-s 120
fi
TAIL=8 run variant-stall-switch 290 python3 benchmarks/variant_stall.py \
  --out "$OUT/records/switch" --quantization fp8 --k 8 --streams 8 --decode-buckets 8,16 \
  --modes background,background_long_switch
