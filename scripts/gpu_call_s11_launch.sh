#!/usr/bin/env bash
# Session 11, call 1 (H200): the batch-1 decode step's host and launch cost.
# decode_launch.py compiles the 8B decode program (FP8, then bf16) with XLA's command buffers
# as they are, off, with WHILE / CONDITIONAL added and with the minimum graph size 1, and times
# the dispatch, a waited step and back-to-back steps of each; it also times the weights'
# argument form (nnx.State vs the flat list the runner now passes). Then the engine's batch-1
# TPOT (gpu_decode.py) for the tree before the flat list ($OLD) and this one.
#   OLD=<snapshot of the previous HEAD> OUT=... bash scripts/gpu_call_s11_launch.sh
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
NEW=$PWD
L="python3 -u benchmarks/decode_launch.py --batch 1 --ctx 512 --steps 30"
TAIL=9 run launch-fp8 200 $L --backend pallas:fp8 --out "$OUT/records/launch_fp8"
TAIL=7 run launch-bf16 130 $L --backend pallas --variants default,cb_off,while_cond_min1 \
  --out "$OUT/records/launch_bf16"
for tree in old new; do
  if [ $tree = old ]; then cd "${OLD:?}"; else cd "$NEW"; fi
  TAIL=4 run e2e-$tree 100 python3 -u benchmarks/gpu_decode.py --quick --peer none \
    --backends pallas:fp8 --batches 1 --steps 24 --budget-s 90 --out "$OUT/records/e2e_$tree"
done
cd "$NEW"
grep -ho '"tpot_ms_[a-z]*": [0-9.]*' "$OUT"/logs/e2e-*.log
