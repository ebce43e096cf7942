#!/usr/bin/env bash
# Session 16 (H200): issue #3's B = 8 points against the stock kernel at more split counts
# (choose_num_splits picks 3 at B8: 192 programs on 132 SMs, 60 SMs with two and 72 with
# one; 4 splits fill two per SM almost evenly). Both merges (XLA fusion / in-kernel, counters
# carried), bf16 and FP8 KV; device checks first.
#   OUT=... bash scripts/gpu_call_s16_splits.sh   (limit 600 s)
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
TAIL=60 run psb-splits 330 python3 -u benchmarks/kernels/bench_paged_small_batch.py \
  --deadline-s 300 --points 8x4096,8x2048,8x1024,fp8:8x4096,1x4096 --splits 2,4,5,8 \
  --out "$OUT/records/psb_splits"
