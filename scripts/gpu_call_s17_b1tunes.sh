#!/usr/bin/env bash
# Session 17, call 1 (H200, ~6 min): two questions about the decode kernel's launch at small
# batches, where #3's "2x stock" misses remain (B1 ctx <= 4096, B4-8 ctx 4096).
# (a) split counts at B = 1: choose_num_splits aims at two waves (33 splits with 8 KV heads, 32
#     after page rounding); session 16's runs had 16 splits ahead by CUPTI time at ctx 2048 /
#     4096 (7.7 / 10.0 vs 8.2 / 10.5 us) and behind at 32k (39.6 vs 38.1). 8 / 16 / 24 splits
#     beside the default at B1 ctx 1024-32k, bf16 and FP8, both merges.
# (b) launch options never swept at the small-batch split counts: num_warps 2 / 8, num_stages 3,
#     block_tokens 32 (at B1 ctx 1024 a split holds 2 pages = 32 tokens, so the default 64-token
#     step masks half) and 128, at the default split count and merge (the engine's call).
#   OUT=... bash scripts/gpu_call_s17_b1tunes.sh   (limit 420 s)
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
TAIL=16 run psb-b1 200 python3 -u benchmarks/kernels/bench_paged_small_batch.py \
  --deadline-s 170 --splits 8,16,24 \
  --points 1x1024,1x2048,1x4096,1x8192,1x32768,fp8:1x2048,fp8:1x8192 \
  --out "$OUT/records/psb_b1"
TAIL=16 run psb-tunes 200 python3 -u benchmarks/kernels/bench_paged_small_batch.py \
  --deadline-s 175 --no-checks --tunes w2,w8,s3,bt32,bt32w2,bt128,bt128w8 \
  --points 1x1024,1x2048,1x4096,8x4096,6x4096,4x4096,fp8:8x4096,fp8:1x4096 \
  --out "$OUT/records/psb_tunes"
