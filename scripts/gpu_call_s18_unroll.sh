#!/usr/bin/env bash
# Session 18, call 1 (H200, ~6 min): straight-line splits (`unroll`, decode.py) at B = 1,
# where #3's "2x stock" misses are largest (ctx 1024-4096: 1.45-1.93x). A split of at most
# `unroll` 64-token steps skips the loop and reads the block table before seq_len arrives
# (one dependent round trip less of the ~5 a program waits on). Prediction: 0.4-0.8 us less
# of the 5.5 / 8.2 / 10.3 us (CUPTI) at ctx 1024 / 2048 / 4096; nothing at B >= 32 (loops).
#   OUT=... bash scripts/gpu_call_s18_unroll.sh   (limit 420 s)
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
TAIL=16 run psb-unroll 230 python3 -u benchmarks/kernels/bench_paged_small_batch.py \
  --deadline-s 200 --tunes u1,u2,u4,sp64u1,sp16u2 \
  --points 1x1024,1x2048,1x4096,1x8192,8x1024,fp8:1x2048,fp8:1x4096 \
  --out "$OUT/records/psb_unroll"
# the same question again, tunes in the other order (call-to-call spread is 1-3 %)
TAIL=12 run psb-unroll-rep 120 python3 -u benchmarks/kernels/bench_paged_small_batch.py \
  --deadline-s 100 --no-checks --tunes u4,sp64u1 --points 1x1024,1x2048,1x4096,fp8:1x2048 \
  --out "$OUT/records/psb_unroll_rep"
