#!/usr/bin/env bash
# Session 21, call 7 (H200, limit 120 s): the bf16 D-256 points still under 2x stock (4/1/256
# B4 / B8, 16/8/256 B1) at other split counts (in-kernel merge) and 8 / 2 warps.
#   OUT=... bash scripts/gpu_call_s21_f.sh
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
PSB="python3 -u benchmarks/kernels/bench_paged_small_batch.py"
TAIL=12 run g4-splits 60 $PSB --deadline-s 48 --no-checks --heads 4/1/256 --splits 8,12,16,24 \
  --tunes w2,sp16w8 --points 4x2048,8x2048 --out "$OUT/records/g4_splits"
TAIL=8 run d256-splits 45 $PSB --deadline-s 33 --no-checks --heads 16/8/256 --splits 12,16,24 \
  --tunes w8,sp16w8 --points 1x2048 --out "$OUT/records/d256_splits"
