#!/usr/bin/env bash
# Session 22, call 4 (H200, limit ~420 s): call 3's KV-write A/B again. (1) bench_kv_write.py
# with straight-line writes (call 3's fori_loop version timed the loop, and its host-side
# checks ran out of time); (2) per-kernel time of the 8B decode step (FP8 weights and FP8 KV,
# 64 rows, ctx 512, synthetic), KV_WRITE_METHOD "scatter" vs "unique".
#   OUT=... bash scripts/gpu_call_s22_d.sh
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
TAIL=14 run kvw 115 python3 -u benchmarks/kernels/bench_kv_write.py --deadline-s 95 \
  --out "$OUT/records/kvw"
for m in unique scatter; do
  TAIL=12 run prof-8b-$m 130 python3 -u benchmarks/profile_decode.py --model dummy:llama-3.1-8b \
    --backend pallas:fp8:fp8 --batch 64 --ctx 512 --steps 10 --synthetic --top 8 \
    --patch "pallas_kernels.paged_attention.reference.KV_WRITE_METHOD=\"$m\"" \
    --out "$OUT/records/prof_8b_$m"
done
