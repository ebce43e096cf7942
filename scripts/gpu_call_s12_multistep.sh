#!/usr/bin/env bash
# Session 12, call 1 (H200, ~9 min): check_row_quant.py (session 11's fused RMSNorm + FP8
# quantization kernel against XLA's unfused math at the 8B / 70B widths, and a small FP8
# engine with and without it: greedy tokens), then multistep_decode.py (n decode steps in one
# program: tokens against single steps, ms per token) for the 8B FP8 and bf16 shapes at
# batch 1, then the engine's batch-1 TPOT on FP8 (gpu_decode --quick).
#   OUT=... bash scripts/gpu_call_s12_multistep.sh   (limit 600 s)
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
TAIL=4 run check 100 python3 -u benchmarks/kernels/check_row_quant.py --out "$OUT/records/check"
M="python3 -u benchmarks/multistep_decode.py --batch 1 --ctx 512 --steps 1,4,16"
TAIL=7 run ms-fp8 170 $M --backend pallas:fp8 --out "$OUT/records/ms"
TAIL=7 run ms-bf16 150 $M --backend pallas --out "$OUT/records/ms"
TAIL=3 run e2e-fp8 110 python3 -u benchmarks/gpu_decode.py --quick --peer none \
  --backends pallas:fp8 --batches 1 --steps 32 --budget-s 100 --out "$OUT/records/e2e"
grep -H -o '"tpot_ms_[a-z]*": [0-9.]*' "$OUT"/logs/e2e-*.log
