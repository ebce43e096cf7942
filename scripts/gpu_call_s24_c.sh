#!/usr/bin/env bash
# Session 24 call 3 (H200): RoPE + KV write in one Pallas kernel
# (rope_kv_write.rope_write_kv_pallas; jaxinfer.layers.pallas_attention.ROPE_KV_WRITE_KERNEL,
# off until timed). (1) check_rope_kv_write: device check against apply_rope + write_kv_ref,
# then CUPTI µs a layer, kernel vs XLA, at the 8B and SmolLM2 points; (2) the 8B decode step
# per kernel (FP8 weights + FP8 KV, ctx 512) at 64 rows and 1 row, kernel on vs off. Adopt if
# device busy drops in both.
#   OUT=... bash scripts/gpu_call_s24_c.sh
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
TAIL=12 run rkw 90 python3 -u benchmarks/kernels/check_rope_kv_write.py --out "$OUT/records/rkw"
ON="--patch jaxinfer.layers.pallas_attention.ROPE_KV_WRITE_KERNEL=True"
P8="python3 -u benchmarks/profile_decode.py --model dummy:llama-3.1-8b --backend pallas:fp8:fp8
  --ctx 512 --steps 10 --synthetic --top 14"
for b in 64 1; do
  # shellcheck disable=SC2086
  TAIL=17 run prof8-b$b-rope 85 $P8 --batch $b $ON --out "$OUT/records/prof8_b${b}_rope"
  # shellcheck disable=SC2086
  TAIL=17 run prof8-b$b-xla 85 $P8 --batch $b --out "$OUT/records/prof8_b${b}_xla"
done
