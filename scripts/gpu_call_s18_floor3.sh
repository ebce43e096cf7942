#!/usr/bin/env bash
# Session 18, call 5 (H200, ~3 min): the B1 call split once more — the block-table read
# probe plus ours' in-kernel merge (bt_merge: partial store, barrier, arrival atomic, the
# last split's merge) without the attention arithmetic, beside the read-only probes, ours
# and stock, at ctx 1024 / 2048 / 4096: how much of ours' ~2.5-3 us over the reads is the
# merge, how much the attention?
#   OUT=... bash scripts/gpu_call_s18_floor3.sh   (limit 200 s)
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
TAIL=12 run b1-floor-merge 170 python3 -u benchmarks/kernels/b1_floor_probe.py \
  --ctx 1024,2048,4096 --deadline-s 150 --out "$OUT/records/b1_floor_merge"
