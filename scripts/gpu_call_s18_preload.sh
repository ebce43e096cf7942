#!/usr/bin/env bash
# Session 18, call 6 (H200, ~3 min): call 5 put ours' in-kernel merge at 1.5-2.0 us of a B1
# call (bt_merge probe minus the read probe). The merging program loaded the splits'
# log2-sum-exps, reduced them, and only then loaded the partials; now the first two chunks
# of partials are loaded with the lse (decode_merge.MERGE_PRELOAD_CHUNKS = 2). Ours against
# "ours pre0" (the old order) in one process; prediction: one L2 round trip (~0.5 us) less.
#   OUT=... bash scripts/gpu_call_s18_preload.sh   (limit 200 s)
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
TAIL=12 run b1-preload 170 python3 -u benchmarks/kernels/b1_floor_probe.py \
  --ctx 1024,2048,4096,8192,32768 --deadline-s 150 --out "$OUT/records/b1_preload"
