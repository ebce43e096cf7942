#!/usr/bin/env bash
# Session 14, call 2 (H200, ~9 min):
# (1) session 12's deep K steps (fp8_plan.FP8_DECODE_DEEP_K) end to end, never measured in
#     the engine: 70B FP8 at batch 1 with JAXINFER_FP8_DECODE_DEEP_K=on / off.
# (2) gate_up's SwiGLU epilogue up to 32 rows (fp8_plan.FP8_GATE_UP_EPILOGUE_MAX_M, 16 now):
#     8B FP8 at batch 32, the constant 16 / 32 (gpu_decode --patch).
#   OUT=... bash scripts/gpu_call_s14_deepk_gateup.sh   (limit 600 s)
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.92  # 67 GiB of 70B FP8 weights + the KV pool
E="python3 -u benchmarks/gpu_decode.py --quick --peer none --backends pallas:fp8 --steps 32"
for deep in on off; do
  JAXINFER_FP8_DECODE_DEEP_K=$deep TAIL=4 run e2e70-deep-$deep 150 $E \
    --model dummy:llama-3.1-70b --batches 1 --budget-s 135 --out "$OUT/records/e2e70_deep_$deep"
done
P=pallas_kernels.matmul.fp8_plan.FP8_GATE_UP_EPILOGUE_MAX_M
for m in 32 16; do
  TAIL=4 run e2e8-gu$m 110 $E --batches 32 --patch $P=$m --budget-s 95 \
    --out "$OUT/records/e2e8_gu$m"
done
grep -H -o '"tpot_ms_[a-z]*": [0-9.]*' "$OUT"/logs/e2e*.log
python3 benchmarks/compare_tokens.py "$OUT"/records/e2e70_deep_{on,off}/gpu_decode_summary.json \
  | tee "$OUT/logs/tokens_deep.log"
python3 benchmarks/compare_tokens.py "$OUT"/records/e2e8_gu{32,16}/gpu_decode_summary.json \
  | tee "$OUT/logs/tokens_gu.log"; pack
