#!/usr/bin/env bash
# Next session (H200, ~6 min): session 12's deep K steps (fp8_plan.FP8_DECODE_DEEP_K) end to
# end, never measured in the engine: 70B FP8 at batch 1 with JAXINFER_FP8_DECODE_DEEP_K=on /
# off, one process each (gpu_decode builds the 70B dummy as FP8 directly since session 13).
#   OUT=... bash scripts/gpu_call_next_s14_deepk.sh   (limit 400 s)
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.92  # 67 GiB of 70B FP8 weights + the KV pool
E="python3 -u benchmarks/gpu_decode.py --quick --peer none --backends pallas:fp8 --steps 32"
for deep in on off; do
  JAXINFER_FP8_DECODE_DEEP_K=$deep TAIL=4 run e2e70-deep-$deep 150 $E \
    --model dummy:llama-3.1-70b --batches 1 --budget-s 135 --out "$OUT/records/e2e70_deep_$deep"
done
grep -H -o '"tpot_ms_[a-z]*": [0-9.]*' "$OUT"/logs/e2e*.log
python3 benchmarks/compare_tokens.py "$OUT"/records/e2e70_deep_{on,off}/gpu_decode_summary.json \
  | tee "$OUT/logs/tokens_deep.log"; pack
