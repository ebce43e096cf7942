#!/usr/bin/env bash
# Next session (H200, ~3 min): at B = 1 choose_num_splits aims at two waves (33 splits with 8
# KV heads, 32 after page rounding); session 16's runs had 16 splits ahead by CUPTI time at
# ctx 2048 / 4096 (7.7 / 10.0 vs 8.2 / 10.5 µs) and behind at 32k (39.6 vs 38.1). Time 8 / 16 /
# 24 splits beside the default at B1 ctx 1024-32k, bf16 and FP8, both merges.
#   OUT=... bash scripts/gpu_call_next_s17.sh   (limit 300 s)
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
TAIL=30 run psb-b1 260 python3 -u benchmarks/kernels/bench_paged_small_batch.py \
  --deadline-s 230 --splits 8,16,24 \
  --points 1x1024,1x2048,1x4096,1x8192,1x32768,fp8:1x2048,fp8:1x8192 \
  --out "$OUT/records/psb_b1"
