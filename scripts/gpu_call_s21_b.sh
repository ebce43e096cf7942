#!/usr/bin/env bash
# Session 21, call 3 (H200, limit 420 s): the head-dim-256 FP8 default (fp8.FP8_WIDE_*: kq8
# below 32 (row, KV head) groups, else the batch table's variant at 32-token steps) against
# the old default (the table alone: --patch FP8_WIDE_HEAD_DIM past any head dim) in a second
# process, at Gemma 3's 4/1/256 and at 16/8/256; device checks of the new default first.
#   OUT=... bash scripts/gpu_call_s21_b.sh
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
PSB="python3 -u benchmarks/kernels/bench_paged_small_batch.py"
OLD="--patch pallas_kernels.paged_attention.fp8.FP8_WIDE_HEAD_DIM=100000"
G4=fp8:4x2048,fp8:8x2048,fp8:16x2048,fp8:32x2048,fp8:64x2048,fp8:128x2048,fp8:16x8192
D256=fp8:4x2048,fp8:16x2048,fp8:64x2048,fp8:128x2048
TAIL=12 run g4-new 110 $PSB --deadline-s 95 --heads 4/1/256 --checks fp8:4x2048,fp8:64x2048 \
  --points $G4 --out "$OUT/records/g4_new"
TAIL=12 run g4-old 95 $PSB --deadline-s 80 --no-checks --heads 4/1/256 $OLD \
  --points $G4 --out "$OUT/records/g4_old"
TAIL=12 run d256-new 90 $PSB --deadline-s 75 --heads 16/8/256 --checks fp8:16x2048 \
  --points $D256 --out "$OUT/records/d256_new"
TAIL=12 run d256-old 75 $PSB --deadline-s 60 --no-checks --heads 16/8/256 $OLD \
  --points $D256 --out "$OUT/records/d256_old"
