#!/usr/bin/env bash
# Session 18, call 3 (H200, ~4 min): the fixed cost of a batch-1 paged decode call.
# b1_floor_probe.py launches our grid with the attention dropped (no reads / fixed-address
# reads / block-table reads / length-then-table reads), beside ours and stock, at B1 ctx
# 1024-8192: is 2x stock (~4.5 / 6.2 / 9.0 us at ctx 1024 / 2048 / 4096) within reach of a
# kernel that only reads the KV once?
#   OUT=... bash scripts/gpu_call_s18_floor.sh   (limit 300 s)
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
TAIL=12 run b1-floor 220 python3 -u benchmarks/kernels/b1_floor_probe.py \
  --ctx 1024,2048,4096,8192 --out "$OUT/records/b1_floor"
