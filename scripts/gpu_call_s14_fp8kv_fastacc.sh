#!/usr/bin/env bash
# Next session (H200, ~8 min): what session 13 could not fit in its device time.
# (1) The paged decode's FP8-KV variants with both dots FP8 on wgmma (fp8.kq8w_bt64 / kq8w,
#     session 13, static analysis only) against the defaults, every config checked against
#     the reference first (bench_paged_fp8_sweep.py).
# (2) The FP8 GEMM dots on wgmma (fp8_plan.FP8_DECODE_FAST_ACCUM) end to end as an A/B in
#     one call: 8B FP8 decode at batch 1 / 16 / 64 with JAXINFER_FP8_DECODE_FAST_ACCUM=on /
#     off (session 13 compared on against another call's process only).
#   OUT=... bash scripts/gpu_call_next_s14.sh   (limit 600 s)
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
TAIL=16 run fp8kv-wgmma 170 python3 -u benchmarks/kernels/bench_paged_fp8_sweep.py \
  --configs cvt,kq8,kq8_bt64_w2,kq8w_bt64,kq8w --deadline-s 150 --out "$OUT/records/fp8kv"
E="python3 -u benchmarks/gpu_decode.py --quick --peer none --backends pallas:fp8 --steps 32"
for fa in on off; do
  JAXINFER_FP8_DECODE_FAST_ACCUM=$fa TAIL=5 run e2e8-fa-$fa 140 $E --batches 1 16 64 \
    --budget-s 125 --out "$OUT/records/e2e8_fa_$fa"
done
grep -H -o '"tpot_ms_[a-z]*": [0-9.]*' "$OUT"/logs/e2e*.log
python3 benchmarks/compare_tokens.py "$OUT"/records/e2e8_fa_{on,off}/gpu_decode_summary.json \
  | tee "$OUT/logs/tokens_fa.log"; pack
