#!/usr/bin/env bash
# Session 10, call 6 (H200): the batch-1 / 64 FP8 decode step as device time with command
# buffers (gpu_decode.py's replay of the compiled decode program on fixed inputs: no host
# work), the tree at 598a6f6 ($OLD) against this one, interleaved: the engine's end-to-end
# batch-1 TPOT varied 3.95-6.43 ms for one tree between processes (calls 3-5).
#   OLD=<snapshot of 598a6f6> OUT=... bash scripts/gpu_call_s10_replay_ab.sh
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
NEW=$PWD
for tree in old new; do
  if [ $tree = old ]; then cd "${OLD:?}"; else cd "$NEW"; fi
  TAIL=4 run replay-$tree 110 python3 -u benchmarks/gpu_decode.py --quick --peer none \
    --backends pallas:fp8 --batches 1 64 --steps 24 --budget-s 100 --out "$OUT/records/replay_$tree"
  grep -o '"tpot_ms_device": [0-9.]*' "$OUT/logs/replay-$tree.log"
done
cd "$NEW"
