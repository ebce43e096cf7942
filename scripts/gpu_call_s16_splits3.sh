#!/usr/bin/env bash
# Session 16 (H200): the new small-batch defaults (choose_num_splits' floor(264 / groups) at
# 32-118 groups, merge="auto" in the kernel up to 64 groups) against the old picks (the XLA
# merge at 3 / 5 splits), bf16 and FP8. "kfresh" rows are the engine's new default.
#   OUT=... bash scripts/gpu_call_s16_splits3.sh   (limit 240 s)
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
TAIL=40 run psb-splits3 200 python3 -u benchmarks/kernels/bench_paged_small_batch.py \
  --deadline-s 170 --no-checks --splits 3,4,5 \
  --points 8x4096,6x4096,4x4096,8x1024,fp8:8x4096,fp8:6x4096,fp8:4x4096 \
  --out "$OUT/records/psb_splits3"
