#!/usr/bin/env bash
# Next session, first call (H200, ~5 min; prepared in session 19; session 20 ran its FP8 part
# inside gpu_call_s20_a.sh, not the B128 tunes). Two questions
# session 19 left (NOTES_paged_attention "Session 19"):
# (1) a wave-aware split count for FP8 KV: kq8_bt64_w2 fits 4 programs an SM (528 slots);
#     B48 ctx2048 read in 70.2 us at 4 splits (1536 programs, 2.9 waves) against 81.9 at the
#     default 2 (768: 1.45 waves). Split counts 1-6 at B16-128 ctx 2048 / 4096 under today's
#     default, to fit a rule on waves rather than a program target;
# (2) B128 ctx4096 bf16 sits at 1.98-2.04x stock with 4 stages: 2 warps, 3 stages and a second
#     split at 4 stages, to see whether 2x holds by wall time as well as by kernel time.
#   OUT=... bash scripts/gpu_call_next_s20.sh   (limit 330 s)
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
PSB="python3 -u benchmarks/kernels/bench_paged_small_batch.py"
TAIL=16 run psb-fp8waves 170 $PSB --deadline-s 155 --no-checks --splits 2,3,4,6 \
  --points fp8:16x2048,fp8:32x2048,fp8:48x2048,fp8:64x2048,fp8:128x2048,fp8:32x4096,fp8:64x4096 \
  --out "$OUT/records/psb_fp8waves"
TAIL=10 run psb-b128 120 $PSB --deadline-s 105 --no-checks --tunes w2,s3,w2s3,sp2 \
  --points 128x4096,64x4096,8x4096 --out "$OUT/records/psb_b128"
