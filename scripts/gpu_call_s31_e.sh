#!/usr/bin/env bash
# Session 31, fifth device call (~170 s, H100 or H200): the 8B FP8 / FP8-KV engine at batch
# 64, one step a program, with the 64-token GEMM tiles of session 31 (64 weight rows, 3
# stages, wgmma FP8 dot: fp8_plan.FP8_DECODE_ROWS_AT_64 = 64, the default) against session
# 13's (128 rows, 2 stages: = 128), one process each on one machine.
#   OUT=... bash scripts/gpu_call_s31_e.sh
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/logs/nvidia-smi.txt"
for rows in 64 128; do
  TAIL=4 run "e2e8-rows$rows" 100 python3 -u benchmarks/gpu_decode.py --batches 64 --steps 64 \
    --backends pallas:fp8:fp8 --budget-s 90 --quick --peer "" \
    --patch "pallas_kernels.matmul.fp8_plan.FP8_DECODE_ROWS_AT_64=$rows" \
    --out "$OUT/records/e2e8_rows$rows"
done
grep -H -o '"tpot_ms_[a-z_]*": [0-9.]*' "$OUT"/logs/e2e8*.log
