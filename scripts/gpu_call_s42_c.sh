#!/usr/bin/env bash
# Session 42 call c (an H200 only, ~150 s + start): session 34's FP8-KV decode sweep at 512
# rows x 1,536 tokens and 128 x 2,048 (the H200 point of issue #3's FP8-KV time ratio; the
# H100 gave 0.517 at 512 x 1,536 in session 33).
#   OUT=... bash scripts/gpu_call_s42_c.sh
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/logs/nvidia-smi.txt"
grep -q H200 "$OUT/logs/nvidia-smi.txt" || { echo "not an H200: nothing run"; exit 0; }
TAIL=40 run fp8kv-b512 150 python3 -u benchmarks/kernels/bench_paged_fp8_sweep.py \
  --out "$OUT/records/b512" --shapes 512x1536,128x2048 --deadline-s 120
