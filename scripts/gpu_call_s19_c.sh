#!/usr/bin/env bash
# Session 19, call 3 (H200, ~8 min). (1) b1_cluster_probe.py: would a split merge through
# distributed shared memory (Mosaic GPU clusters) bring B1 ctx <= 4096 under 2x stock's time?
# TMA reads with and without the cluster merge, beside the Triton read / global-merge probes,
# ours and stock. (2) The new defaults (num_stages 4 for bf16 past 3 programs an SM;
# FP8 kq8_bt64_w2 at ~4 programs an SM from 4 rows) against the old ones (--patch) in a
# second process, with device checks (B128 and FP8 B8 added) in the first.
#   OUT=... bash scripts/gpu_call_s19_c.sh   (limit 560 s)
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
PSB="python3 -u benchmarks/kernels/bench_paged_small_batch.py"
TAIL=12 run b1-cluster 120 python3 -u benchmarks/kernels/b1_cluster_probe.py --deadline-s 100 \
  --out "$OUT/records/b1_cluster"
PTS=128x4096,64x2048,64x4096,128x1024,256x2048,48x2048,32x2048,8x4096,1x1024
PTS=$PTS,fp8:8x4096,fp8:6x4096,fp8:4x4096,fp8:8x1024,fp8:8x2048,fp8:16x2048,fp8:32x2048
PTS=$PTS,fp8:48x2048,fp8:64x2048,fp8:1x2048
TAIL=30 run psb-new 200 $PSB --deadline-s 185 --points $PTS --out "$OUT/records/psb_new"
TAIL=30 run psb-old 170 $PSB --deadline-s 155 --no-checks --points $PTS \
  --patch pallas_kernels.paged_attention.decode_options.STAGES_MANY_PROGRAMS=5 \
  --patch "pallas_kernels.paged_attention.fp8.FP8_DECODE_BY_BATCH=((64,'kq8_bt64_w2'),(8,'cvt'),(1,'kq8'))" \
  --out "$OUT/records/psb_old"
