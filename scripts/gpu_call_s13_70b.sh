#!/usr/bin/env bash
# Session 13, call 3 (H200, ~9 min): Llama-3.1-70B FP8 (random weights) decode TPOT at batch
# 1 / 32 with session 13's decode GEMM tiles (JAXINFER_FP8_DECODE_TILES=wave15, the
# default) and session 12's (wave2), one process each; deep K steps on in both.
#   OUT=... bash scripts/gpu_call_s13_70b.sh   (limit 600 s)
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.92  # 67 GiB of 70B FP8 weights + the KV pool
E="python3 -u benchmarks/gpu_decode.py --quick --peer none --backends pallas:fp8 --steps 32"
for tiles in wave15 wave2; do
  JAXINFER_FP8_DECODE_TILES=$tiles TAIL=4 run e2e70-$tiles 235 $E --model dummy:llama-3.1-70b \
    --batches 1 32 --budget-s 215 --out "$OUT/records/e2e70_$tiles"
done
grep -H -o '"tpot_ms_[a-z]*": [0-9.]*' "$OUT"/logs/e2e*.log
