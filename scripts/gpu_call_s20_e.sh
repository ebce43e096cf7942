#!/usr/bin/env bash
# Session 20, call 5 (H200, limit 170 s): the new defaults at 96-128 (row, KV head) groups --
# two splits up to 132 groups (SPLIT_MAX_GROUPS, was 118) and the merge in the kernel up to
# 128 groups (MERGE_KERNEL_MAX_GROUPS, was 64) -- against the old ones (--patch) in a second
# process: bf16 B16 ctx 2048 / 4096, B12 ctx 2048, FP8 B12 / B16 ctx 2048.
#   OUT=... bash scripts/gpu_call_s20_e.sh
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
PSB="python3 -u benchmarks/kernels/bench_paged_small_batch.py"
PTS=16x4096,16x2048,12x2048,fp8:16x2048,fp8:12x2048
TAIL=10 run psb-new 80 $PSB --deadline-s 66 --no-checks --points $PTS \
  --out "$OUT/records/psb_new"
TAIL=10 run psb-old 80 $PSB --deadline-s 66 --no-checks --points $PTS \
  --patch pallas_kernels.paged_attention.decode_options.SPLIT_MAX_GROUPS=118 \
  --patch pallas_kernels.paged_attention.decode_merge.MERGE_KERNEL_MAX_GROUPS=64 \
  --out "$OUT/records/psb_old"
