#!/usr/bin/env bash
# Session 32, first device call (~480 s, H100 or H200):
# 1. FP8-KV decode kernels at 64-token pages against 16 (the engine's default): the FP8
#    kernels are bound by per-step work (block-table gathers, masks, softmax), not bytes,
#    and a 64-token page gives a 64-token step one block-table entry instead of four.
#    The engine's by-batch default (fp8.variant_for_batch), cvt, kq8 and kq8_bt64_w2,
#    and one-warp programs (kq8_bt64_w1, kq8_bt32_w1_tp1056: the softmax reductions over
#    tokens stay inside a warp), each against bf16's default at the same page size, every
#    config checked first.
# 2. Session 31's prepared engine A/B of the 64-token GEMM tiles (fp8_plan.FP8_DECODE_ROWS_AT_64
#    = 64, the default since session 31, against 128, session 13's tiles), 8B batch 64.
#   OUT=... bash scripts/gpu_call_s32_a.sh
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/logs/nvidia-smi.txt"
for ps in 64 16; do
  TAIL=24 run "fp8kv-ps$ps" 135 python3 -u benchmarks/kernels/bench_paged_fp8_sweep.py \
    --configs by_batch,cvt,kq8,kq8_bt64_w2,kq8_bt64_w1,kq8_bt32_w1_tp1056 --page-size "$ps" \
    --deadline-s 110 \
    --out "$OUT/records/fp8kv_ps$ps"
done
for rows in 64 128; do
  TAIL=4 run "e2e8-rows$rows" 100 python3 -u benchmarks/gpu_decode.py --batches 64 --steps 64 \
    --backends pallas:fp8:fp8 --budget-s 90 --quick --peer "" \
    --patch "pallas_kernels.matmul.fp8_plan.FP8_DECODE_ROWS_AT_64=$rows" \
    --out "$OUT/records/e2e8_rows$rows"
done
grep -H -o '"tpot_ms_[a-z_]*": [0-9.]*' "$OUT"/logs/e2e8*.log
