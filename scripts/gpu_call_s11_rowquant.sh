#!/usr/bin/env bash
# Session 11, call 7 (H200): the fused RMSNorm + per-token FP8 quantization kernel
# (row_quant.norm_quant_fp8). First its GPU check (kernel vs the unfused math at the 8B / 70B
# widths; a small FP8 engine with and without it: greedy tokens), then the 8B FP8 batch-1
# decode program's kernel count, dispatch, waited and back-to-back step time for this tree
# and the tree before it ($OLD).
#   OLD=<snapshot before the kernel> OUT=... bash scripts/gpu_call_s11_rowquant.sh
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
NEW=$PWD
TAIL=4 run check 60 python3 -u benchmarks/kernels/check_row_quant.py --out "$OUT/records/check"
L="python3 -u benchmarks/decode_launch.py --batch 1 --ctx 512 --steps 40 --backend pallas:fp8"
for tree in new old; do
  if [ $tree = old ]; then cd "${OLD:?}"; else cd "$NEW"; fi
  TAIL=4 run launch-$tree 80 $L --variants default --out "$OUT/records/launch_$tree"
done
cd "$NEW"
