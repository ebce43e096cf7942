#!/usr/bin/env bash
# Session 20, call 1 (H200, limit 590 s). Three questions (NOTES_paged_attention "Session 20"):
# (1) ncu: where the FP8 KV decode kernel's time goes against bf16's (DRAM %, issue %, stall
#     reasons) at B64 ctx2048 / B8 ctx4096 / B128 ctx2048 (ncu works on Firecracker only);
# (2) num_stages at D 256 (16/8/256, Gemma 3 12B's heads) and D 64 (32/8/64): does the 4-stage
#     rule's crossing sit where session 19 predicted (D 256 near 132 programs, D 64 near 396)?
# (3) session 19's prepared FP8 split counts by waves (2, 3, 4, 6 splits at B16-128).
#   OUT=... bash scripts/gpu_call_s20_a.sh
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
uname -r; nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
PSB="python3 -u benchmarks/kernels/bench_paged_small_batch.py"
TAIL=30 run ncu 170 bash scripts/ncu_decode.sh "$OUT/records/ncu_decode.csv" \
  --cases bf16:64x2048,fp8:64x2048,bf16:8x4096,fp8:8x4096,fp8:128x2048 \
  --out "$OUT/records/ncu_checks.json"
TAIL=12 run psb-d256 75 $PSB --deadline-s 62 --no-checks --heads 16/8/256 --tunes s3,s4,s5 \
  --points 16x2048,32x2048,64x2048 --out "$OUT/records/psb_d256"
TAIL=12 run psb-d64 65 $PSB --deadline-s 52 --no-checks --heads 32/8/64 --tunes s4,s5 \
  --points 64x2048,128x2048,32x2048 --out "$OUT/records/psb_d64"
TAIL=16 run psb-fp8waves 150 $PSB --deadline-s 135 --no-checks --splits 2,3,4,6 \
  --points fp8:48x2048,fp8:32x2048,fp8:64x2048,fp8:16x2048,fp8:128x2048,fp8:32x4096,fp8:64x4096 \
  --out "$OUT/records/psb_fp8waves"
