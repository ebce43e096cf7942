#!/usr/bin/env bash
# Next session, first call (H200, ~5 min): session 18's merge preload
# (decode_merge.MERGE_PRELOAD_CHUNKS = 2: the merging program's partial loads leave with its
# lse load) was measured at B = 1 only (0-0.24 us a call less). Here at B = 4-8 (one chunk of
# partials; B8 ctx4096 stands at 2.01x stock by kernel time, 1.98x by wall) and FP8, the
# default against the old order (--patch ...=0) in a second process (CUPTI kernel times
# agree across processes to ~0.1 us).
#   OUT=... bash scripts/gpu_call_next_s19.sh   (limit 300 s)
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
PTS=8x4096,6x4096,4x4096,8x1024,fp8:8x4096,fp8:4x4096,1x1024,1x2048
TAIL=14 run psb-preload 140 python3 -u benchmarks/kernels/bench_paged_small_batch.py \
  --deadline-s 120 --points $PTS --out "$OUT/records/psb_preload"
TAIL=14 run psb-preload0 130 python3 -u benchmarks/kernels/bench_paged_small_batch.py \
  --deadline-s 110 --no-checks --points $PTS \
  --patch pallas_kernels.paged_attention.decode_merge.MERGE_PRELOAD_CHUNKS=0 \
  --out "$OUT/records/psb_preload0"
