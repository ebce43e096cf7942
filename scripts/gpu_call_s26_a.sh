#!/usr/bin/env bash
# Next session (H200, ~450 s of a 600 s limit; prepared in session 24, not run: no device was
# lent for it): QKV bias / QK norm, RoPE and the KV write in one Pallas kernel
# (rope_kv_write.rope_write_kv_pallas; jaxinfer.layers.pallas_attention.ROPE_KV_WRITE_KERNEL,
# off until timed). (1) check_rope_kv_write: device check against the XLA path (apply_rope +
# write_kv_ref, with Gemma 3's QK norm and Qwen2's bias), then CUPTI µs a layer, kernel vs
# XLA; (2) the 8B decode step per kernel (FP8 weights + FP8 KV, ctx 512) at 64 rows and 1 row,
# kernel on vs off; (3) Gemma 3 270M (QK norm, head dim 256), bf16, 4 rows, ctx 2048 (a #3
# gap: launch-bound), on vs off. Adopt where device busy drops.
#   OUT=... bash scripts/gpu_call_s26_a.sh
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
TAIL=16 run rkw 100 python3 -u benchmarks/kernels/check_rope_kv_write.py --out "$OUT/records/rkw"
ON="--patch jaxinfer.layers.pallas_attention.ROPE_KV_WRITE_KERNEL=True"
P8="python3 -u benchmarks/profile_decode.py --model dummy:llama-3.1-8b --backend pallas:fp8:fp8
  --ctx 512 --steps 10 --synthetic --top 14"
for b in 64 1; do
  # shellcheck disable=SC2086
  TAIL=17 run prof8-b$b-rope 85 $P8 --batch $b $ON --out "$OUT/records/prof8_b${b}_rope"
  # shellcheck disable=SC2086
  TAIL=17 run prof8-b$b-xla 85 $P8 --batch $b --out "$OUT/records/prof8_b${b}_xla"
done
G="python3 -u benchmarks/profile_decode.py --model dummy:gemma-3-270m --backend pallas
  --batch 4 --ctx 2048 --steps 10 --synthetic --top 14"
# shellcheck disable=SC2086
TAIL=17 run g270-b4-rope 70 $G $ON --out "$OUT/records/g270_b4_rope"
# shellcheck disable=SC2086
TAIL=17 run g270-b4-xla 70 $G --out "$OUT/records/g270_b4_xla"
