#!/usr/bin/env bash
# (Not run: no machine was lent for it; superseded by the call that ran in session 28 as gpu_call_s28_a.sh.)
# Session 27, call 2 (H200 or H100, ~480 s): (1) check_rope_kv_write with the donated caches
# carried through CUPTI (call 1 checked its first point on the device -- the session-26 hang
# is gone -- then stopped: JAX's profiler.measure calls the run with the same, donated,
# arrays); (2) transformer.FUSE_SPLITK_RESIDUAL (the o / down GEMMs' split-K partials summed
# in the next norm + quant kernel; call 1's bench_row_quant: 2.67 vs 2.87 µs at 1 row, 4.92 vs
# 5.41 at 64) in the 8B FP8 + FP8 KV decode step, the RoPE kernel on, 64 rows and 1 row:
# device busy per step, on vs off, unrolled layers (the fusion's residual carry needs them).
#   OUT=... bash scripts/gpu_call_s27_b.sh
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
TAIL=24 run rkw 120 python3 -u benchmarks/kernels/check_rope_kv_write.py --out "$OUT/records/rkw"
RK="--patch jaxinfer.layers.pallas_attention.ROPE_KV_WRITE_KERNEL=True"
SK="--patch jaxinfer.models.transformer.FUSE_SPLITK_RESIDUAL=True"
P8="python3 -u benchmarks/profile_decode.py --model dummy:llama-3.1-8b --backend pallas:fp8:fp8
  --ctx 512 --steps 10 --synthetic --top 14"
for b in 64 1; do
  # shellcheck disable=SC2086
  TAIL=17 run prof8-b$b-sk 80 $P8 --batch $b $RK $SK --out "$OUT/records/prof8_b${b}_sk"
  # shellcheck disable=SC2086
  TAIL=17 run prof8-b$b-base 80 $P8 --batch $b $RK --out "$OUT/records/prof8_b${b}_base"
done
grep -H "busy\|span" "$OUT"/logs/prof8*.log | cut -c1-160
