#!/usr/bin/env bash
# Session 42 call a (either card; ~230 s, ~380 s on an H200 -- say which card):
# 1. session 41 call b, not run then: the variant stall (Llama-3.1-8B FP8, k = 8, 8 greedy
#    streams, a first top-p request at step 10) with the background build at the engine's
#    0.5 ms switch interval (runner_multi.BACKGROUND_SWITCH_INTERVAL_S) against Python's 5 ms,
#    both with the GC heap frozen as the server does;
# 2. on an H200 only: session 34's FP8-KV decode sweep at 512 rows x 1,536 tokens
#    (the H200 point of the FP8-KV time ratio, issue #3).
#   OUT=... bash scripts/gpu_call_s42_a.sh
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/logs/nvidia-smi.txt"
TAIL=8 run variant-stall-switch 280 python3 benchmarks/variant_stall.py \
  --out "$OUT/records/switch" --quantization fp8 --k 8 --streams 8 --decode-buckets 8,16 \
  --modes background,background_long_switch
if grep -q H200 "$OUT/logs/nvidia-smi.txt"; then
  TAIL=40 run fp8kv-b512 150 python3 -u benchmarks/kernels/bench_paged_fp8_sweep.py \
    --out "$OUT/records/b512" --shapes 512x1536,128x2048 --deadline-s 120
fi
