#!/usr/bin/env bash
# Next session (H200, ~9 min): what session 13 could not fit in its device time.
# (1) The FP8 dots on wgmma (fp8_plan.FP8_DECODE_FAST_ACCUM) end to end as an A/B in one
#     call: 8B FP8 decode at batch 1 / 16 / 64 with JAXINFER_FP8_DECODE_FAST_ACCUM=on / off
#     (session 13 compared on against another call's process only).
# (2) Deep K steps end to end (session 12's FP8_DECODE_DEEP_K; never measured in the
#     engine): 70B FP8 at batch 1 with JAXINFER_FP8_DECODE_DEEP_K=on / off.
#   OUT=... bash scripts/gpu_call_next_s14.sh   (limit 600 s)
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
E="python3 -u benchmarks/gpu_decode.py --quick --peer none --backends pallas:fp8 --steps 32"
for fa in on off; do
  JAXINFER_FP8_DECODE_FAST_ACCUM=$fa TAIL=5 run e2e8-fa-$fa 140 $E --batches 1 16 64 \
    --budget-s 125 --out "$OUT/records/e2e8_fa_$fa"
done
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.92  # 67 GiB of 70B FP8 weights + the KV pool
for deep in on off; do
  JAXINFER_FP8_DECODE_DEEP_K=$deep TAIL=4 run e2e70-deep-$deep 140 $E \
    --model dummy:llama-3.1-70b --batches 1 --budget-s 125 --out "$OUT/records/e2e70_deep_$deep"
done
grep -H -o '"tpot_ms_[a-z]*": [0-9.]*' "$OUT"/logs/e2e*.log
