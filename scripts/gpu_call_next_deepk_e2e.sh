#!/usr/bin/env bash
# Next session (H200, ~9 min): the deep-K decode GEMM tiles end to end (session 12 measured
# them per GEMM only: NOTES_matmul "Session 12"). The engine's decode TPOT with
# JAXINFER_FP8_DECODE_DEEP_K=on (default) and =off, interleaved in one call: Llama-3.1-70B FP8
# at batch 1 and 8 (every 70B projection but gate_up takes the deep tiles at <= 16 rows), then
# 8B FP8 at batch 1 (only down changes).
#   OUT=... bash scripts/gpu_call_next_deepk_e2e.sh   (limit 600 s)
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.92  # 67 GiB of 70B FP8 weights + the KV pool
E="python3 -u benchmarks/gpu_decode.py --quick --peer none --backends pallas:fp8 --steps 32"
for deep in on off; do
  JAXINFER_FP8_DECODE_DEEP_K=$deep TAIL=3 run e2e70-$deep 170 $E --model dummy:llama-3.1-70b \
    --batches 1 8 --budget-s 150 --out "$OUT/records/e2e70_$deep"
done
for deep in on off; do
  JAXINFER_FP8_DECODE_DEEP_K=$deep TAIL=3 run e2e8-$deep 90 $E --batches 1 --budget-s 80 \
    --out "$OUT/records/e2e8_$deep"
done
grep -H -o '"tpot_ms_[a-z]*": [0-9.]*' "$OUT"/logs/e2e*.log
