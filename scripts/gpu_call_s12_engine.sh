#!/usr/bin/env bash
# Session 12, call 2 (H200, ~9 min): check_row_quant.py with its engine half in float32
# (fused vs unfused must give equal greedy tokens) and bf16 (each against float32, reported);
# bench_matmul --plan engine (the Triton W8A8 decode GEMM alone, as the engine calls it after
# norm_quant_fp8, beside XLA bf16 and the per-call figure with XLA's quantization) at the 8B
# and 70B shapes, M = 1 / 16 / 64; then the engine's batch-1 FP8 TPOT for this tree and $OLD
# (a snapshot of 29356ef: before the fused kernel), in one call on one host.
#   OLD=<snapshot of 29356ef> OUT=... bash scripts/gpu_call_s12_engine.sh   (limit 600 s)
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
NEW=$PWD
TAIL=6 run check 140 python3 -u benchmarks/kernels/check_row_quant.py --out "$OUT/records/check"
TAIL=40 run mm-engine 200 python3 -u benchmarks/kernels/bench_matmul.py --plan engine \
  --ms 1,16,64 --shapes 8b_qkv,8b_o,8b_gate_up,8b_down,70b_up,70b_o --ceilings bw --budget 150 \
  --out "$OUT/records/mm"
E="python3 -u benchmarks/gpu_decode.py --quick --peer none --backends pallas:fp8 --batches 1
  --steps 32 --budget-s 90"
for tree in new old; do
  if [ $tree = old ]; then cd "${OLD:?}"; else cd "$NEW"; fi
  TAIL=3 run e2e-$tree 100 $E --out "$OUT/records/e2e_$tree"
done
cd "$NEW"
grep -H -o '"tpot_ms_[a-z]*": [0-9.]*' "$OUT"/logs/e2e-*.log
