#!/usr/bin/env bash
# Session 24 call 1 (H200, ran: 298 s; prepared in session 23): the KV write on the
# Pallas kernel (kv_write.write_kv_pallas, jaxinfer.layers.pallas_attention.KV_WRITE_KERNEL,
# off until timed) against session 22's XLA methods. (1) bench_kv_write: unique / rows /
# kernel, bit-checked on the device first, at the 8B and Gemma 270M points; (2) the 8B decode
# step per kernel (FP8 weights + FP8 KV, ctx 512) at 64 rows and 1 row, kernel on vs off (a
# full-pool copy from the aliasing would show as a copy of ~GBs; both also show whether the
# 64 memcpy32_post launches of the FP8-KV scales are gone: per-layer scale buffers). Adopt if device busy
# drops in the profiles (then Gemma 3 270M's step, head dim 256, in a later call).
#   OUT=... bash scripts/gpu_call_next_s24_b.sh
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
TAIL=16 run kvw 120 python3 -u benchmarks/kernels/bench_kv_write.py --methods unique,rows,kernel \
  --deadline-s 100 --out "$OUT/records/kvw"
ON="--patch jaxinfer.layers.pallas_attention.KV_WRITE_KERNEL=True"
P8="python3 -u benchmarks/profile_decode.py --model dummy:llama-3.1-8b --backend pallas:fp8:fp8
  --ctx 512 --steps 10 --synthetic --top 14"
for b in 64 1; do
  # shellcheck disable=SC2086
  TAIL=16 run prof8-b$b-kernel 85 $P8 --batch $b $ON --out "$OUT/records/prof8_b${b}_kernel"
  # shellcheck disable=SC2086
  TAIL=16 run prof8-b$b-xla 85 $P8 --batch $b --out "$OUT/records/prof8_b${b}_xla"
done
