#!/usr/bin/env bash
# Session 21, call 5 (H200, limit 330 s): the 16-bit head-dim-256 defaults (decode_options.
# WIDE_*: 8 warps below 16 (row, KV head) groups, 32-token steps from 16 to SPLIT_MAX_GROUPS)
# against the old defaults (--patch WIDE_HEAD_DIM past any head dim) in a second process, at
# Gemma 3's 4/1/256 and at 16/8/256 (B1 / B2 there: 8 warps never timed); device checks first.
#   OUT=... bash scripts/gpu_call_s21_d.sh
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
PSB="python3 -u benchmarks/kernels/bench_paged_small_batch.py"
OLD="--patch pallas_kernels.paged_attention.decode_options.WIDE_HEAD_DIM=100000"
G4=1x2048,4x2048,8x2048,16x2048,64x2048,128x2048,256x2048,16x8192,1x8192
D256=1x2048,2x2048,4x2048,16x2048
TAIL=12 run g4-new 90 $PSB --deadline-s 75 --heads 4/1/256 --checks 1x2048,16x2048 \
  --points $G4 --out "$OUT/records/g4_new"
TAIL=12 run g4-old 75 $PSB --deadline-s 60 --no-checks --heads 4/1/256 $OLD \
  --points $G4 --out "$OUT/records/g4_old"
TAIL=10 run d256-new 60 $PSB --deadline-s 45 --heads 16/8/256 --checks 1x2048,4x2048 \
  --points $D256 --out "$OUT/records/d256_new"
TAIL=10 run d256-old 50 $PSB --deadline-s 35 --no-checks --heads 16/8/256 $OLD \
  --points $D256 --out "$OUT/records/d256_old"
