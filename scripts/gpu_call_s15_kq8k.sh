#!/usr/bin/env bash
# Session 15 (H200, ~3 min): the kq8k FP8-KV variants (K q8ᵀ on wgmma, V widened) against
# cvt / kq8 / kq8_bt64_w2 / kq8w_bt64, each checked against the reference on the GPU first.
#   OUT=... bash scripts/gpu_call_s15_kq8k.sh
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
TAIL=16 run fp8kv-kq8k 200 python3 -u benchmarks/kernels/bench_paged_fp8_sweep.py \
  --configs cvt,kq8,kq8_bt64_w2,kq8k_bt64,kq8k,kq8w_bt64 --deadline-s 170 --out "$OUT/records/fp8kv"
