#!/usr/bin/env bash
# Session 11, call 6 (H200): the batch-1 decode step is host-bound by the launch of its one
# CUDA graph (~2 us of host time a node, ~810 nodes for 8B FP8; calls 1-5). Do XLA's
# experimental Triton fusions cut the kernel count? decode_launch.py compiles the FP8 decode
# program with each (logits checked against the default program's on the same inputs), then
# the engine's batch-1 TPOT (gpu_decode.py) with the variant of the lowest waited step time
# (if it beats the default by > 3 % with the same argmax) as XLA_FLAGS, and without.
#   OUT=... bash scripts/gpu_call_s11_fusions.sh
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
TAIL=12 run fusions-fp8 170 python3 -u benchmarks/decode_launch.py --batch 1 --ctx 512 \
  --steps 30 --backend pallas:fp8 --dump-hlo \
  --variants default,heroless,block_level,block_heroless,all_triton,multi_output \
  --out "$OUT/records/fusions_fp8"
FLAGS=$(pick_flags "$OUT/records/fusions_fp8/decode_launch.json")
echo "picked XLA_FLAGS: '${FLAGS}'"
if [ -n "$FLAGS" ]; then
  E="python3 -u benchmarks/gpu_decode.py --quick --peer none --backends pallas:fp8 --batches 1
    --steps 24 --budget-s 90"
  XLA_FLAGS="$FLAGS" TAIL=3 run e2e-picked 100 $E --out "$OUT/records/e2e_picked"
  TAIL=3 run e2e-default 100 $E --out "$OUT/records/e2e_default"
  grep -H -o '"tpot_ms_[a-z]*": [0-9.]*' "$OUT"/logs/e2e-*.log
fi
