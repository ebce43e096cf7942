#!/usr/bin/env bash
# Session 19, call 2 (H200, ~4 min). Call 1 found (records paged_small_batch_h200_s19call1):
# bf16 B128 ctx2048 with num_stages 4 (one K/V buffer) 242 vs 250 us (4375 GB/s) while B32
# loses 8 % with it; FP8 B8 ctx4096 with kq8_bt64_w2 and 8 splits 26.6 vs 28.1 us (cvt, 4).
# Here: (1) where num_stages 4 / 3 pay for bf16 (B 64-256, ctx 1024-4096; B128 ctx4096 is the
# issue's 2x miss), (2) FP8 at B 4-16 with kq8_bt64_w2 at 8 / 16 splits, against the default in
# a separate process.
#   OUT=... bash scripts/gpu_call_s19_b.sh   (limit 400 s)
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
PSB="python3 -u benchmarks/kernels/bench_paged_small_batch.py"
TAIL=10 run psb-stages 130 $PSB --deadline-s 115 --no-checks \
  --points 128x4096,64x2048,64x4096,128x1024,256x2048,48x2048 --tunes s4,s3,w2s4 \
  --out "$OUT/records/psb_stages"
F8=fp8:8x4096,fp8:4x4096,fp8:6x4096,fp8:8x1024,fp8:8x2048,fp8:16x2048
TAIL=10 run psb-fp8def 70 $PSB --deadline-s 60 --no-checks --points $F8 \
  --out "$OUT/records/psb_fp8def"
TAIL=10 run psb-fp8w2 110 $PSB --deadline-s 95 --no-checks --points $F8 --splits 8,16 \
  --patch "pallas_kernels.paged_attention.fp8.FP8_DECODE_BY_BATCH=((4,'kq8_bt64_w2'),(1,'kq8'))" \
  --out "$OUT/records/psb_fp8w2"
