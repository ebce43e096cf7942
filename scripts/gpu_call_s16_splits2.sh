#!/usr/bin/env bash
# Session 16 (H200), after gpu_call_s16_splits.sh (4 splits won at B8 with the in-kernel merge
# and for FP8 with either merge): the engine's own forms at more points — the XLA merge and the
# in-kernel merge with fresh counters ("kfresh", what merge="auto" runs without carried
# counters) at 4 / 5 / 16 splits beside the current picks, bf16 and FP8, B 1 / 4 / 6 / 8.
#   OUT=... bash scripts/gpu_call_s16_splits2.sh   (limit 420 s)
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
TAIL=90 run psb-splits2 360 python3 -u benchmarks/kernels/bench_paged_small_batch.py \
  --deadline-s 320 --no-checks --splits 4,5,16 \
  --points 8x4096,8x2048,8x1024,fp8:8x4096,fp8:8x2048,4x4096,fp8:4x4096,6x4096,fp8:6x4096,1x2048,1x32768,fp8:1x2048 \
  --out "$OUT/records/psb_splits2"
