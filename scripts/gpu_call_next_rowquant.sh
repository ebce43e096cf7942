#!/usr/bin/env bash
# Next session (H200), one call of ~8 minutes: what session 11's call 8 could not finish.
# check_row_quant.py (the fused RMSNorm + FP8 quantization kernel against XLA's unfused math
# at the 8B / 70B widths; a small FP8 engine with and without it: greedy tokens), then the 8B
# FP8 batch-1 decode program (kernel count, dispatch, waited and back-to-back step) and the
# engine's batch-1 TPOT, for this tree and $OLD (a snapshot of 29356ef: before the kernel),
# interleaved.
#   OLD=<snapshot of 29356ef> OUT=... bash scripts/gpu_call_next_rowquant.sh   (limit 600 s)
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
NEW=$PWD
TAIL=4 run check 100 python3 -u benchmarks/kernels/check_row_quant.py --out "$OUT/records/check"
L="python3 -u benchmarks/decode_launch.py --batch 1 --ctx 512 --steps 40 --backend pallas:fp8
  --variants default"
E="python3 -u benchmarks/gpu_decode.py --quick --peer none --backends pallas:fp8 --batches 1
  --steps 32 --budget-s 100"
for tree in new old; do
  if [ $tree = old ]; then cd "${OLD:?}"; else cd "$NEW"; fi
  TAIL=3 run launch-$tree 80 $L --out "$OUT/records/launch_$tree"
  TAIL=3 run e2e-$tree 110 $E --out "$OUT/records/e2e_$tree"
done
cd "$NEW"
grep -H -o '"tpot_ms_[a-z]*": [0-9.]*' "$OUT"/logs/e2e-*.log
