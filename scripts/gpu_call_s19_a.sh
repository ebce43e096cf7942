#!/usr/bin/env bash
# Session 19, call 1 (H200, ~7 min): (1) session 18's merge preload
# (decode_merge.MERGE_PRELOAD_CHUNKS = 2, measured at B = 1 only) at B = 4-8 and FP8 against
# the old order (--patch ...=0) in a second process; (2) FP8 KV at B = 32-128 (t/bf16 0.61-0.72,
# the issue asks 0.5): launch options that give more programs an SM (num_stages 3 / 4 keep one
# K/V buffer instead of two: about half the shared memory of kq8_bt64_w2's 52 KB, so up to 8
# programs an SM instead of 4; 32-token steps), beside bf16 at B32 / B128 ctx2048; then the same
# FP8 points with kq8_bt64_w2 from 32 rows (by_batch uses cvt below 64).
#   OUT=... bash scripts/gpu_call_s19_a.sh   (limit 560 s)
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
PSB="python3 -u benchmarks/kernels/bench_paged_small_batch.py"
PTS=8x4096,4x4096,8x1024,fp8:8x4096
TAIL=10 run psb-preload 110 $PSB --deadline-s 95 --points $PTS --out "$OUT/records/psb_preload"
TAIL=10 run psb-preload0 90 $PSB --deadline-s 80 --no-checks --points $PTS \
  --patch pallas_kernels.paged_attention.decode_merge.MERGE_PRELOAD_CHUNKS=0 \
  --out "$OUT/records/psb_preload0"
FP=32x2048,128x2048,fp8:32x2048,fp8:64x2048,fp8:128x2048
TAIL=12 run psb-fp8tunes 150 $PSB --deadline-s 135 --no-checks --points $FP \
  --tunes s3,s4,w2s3,w2s4,bt32w2,bt32w2s4,w8s4 --out "$OUT/records/psb_fp8tunes"
TAIL=12 run psb-fp8kq 100 $PSB --deadline-s 85 --no-checks \
  --points fp8:32x2048,fp8:64x2048,fp8:8x4096 --tunes s3,s4,w4 \
  --patch "pallas_kernels.paged_attention.fp8.FP8_DECODE_BY_BATCH=((8,'kq8_bt64_w2'),(1,'kq8'))" \
  --out "$OUT/records/psb_fp8kq"
