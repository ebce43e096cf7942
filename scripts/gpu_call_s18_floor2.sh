#!/usr/bin/env bash
# Session 18, call 4 (H200, ~5 min): call 3 found the block-table read probe (our grid, the
# attention dropped) at 2.5 / 4.8 / 8.1 us at B1 ctx 1024 / 2048 / 4096 against 2x stock's
# 4.5 / 6.1 / 9.0: at ctx 2048-4096 our grid reads the KV at only 2.1-2.4 TB/s. Which grid
# (splits 16 / 32 / 64, 4 / 8 warps, 32- / 64- / 128-token steps) reads it fastest, and how
# fast is ours at the same grid?
#   OUT=... bash scripts/gpu_call_s18_floor2.sh   (limit 330 s)
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
TAIL=14 run b1-floor-sweep 300 python3 -u benchmarks/kernels/b1_floor_probe.py \
  --ctx 2048,4096,1024 --deadline-s 265 --sweep-splits 16,32,64 --sweep-warps 4,8 \
  --sweep-block-tokens 32,64,128 --out "$OUT/records/b1_floor_sweep"
