#!/usr/bin/env bash
# Session 20, call 4 (H200, limit 200 s): bf16 KV between B8 and B32, never measured. The split
# rule gives one split from 119 (row, KV head) groups on (B16: 128 programs, one an SM) and
# floor(264 / groups) below (B12: 2); B32's 256 programs run at 4.1 TB/s. Split counts 2 and 3
# at B12 / B16 / B24, stock beside, 8B heads.
#   OUT=... bash scripts/gpu_call_s20_d.sh
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
PSB="python3 -u benchmarks/kernels/bench_paged_small_batch.py"
TAIL=14 run psb-mid 150 $PSB --deadline-s 135 --no-checks --splits 2,3,4 \
  --points 16x2048,24x2048,16x4096,12x2048 --out "$OUT/records/psb_mid"
