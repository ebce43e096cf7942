#!/usr/bin/env bash
# Session 26, call 2 (H200, ~330 s): call 1 (gpu_call_s26_a.sh) showed the RoPE + KV write
# kernel lowering the 8B FP8 step's device busy at 64 rows (4.209 -> 4.113 ms) and 1 row
# (2.809 -> 2.719) and Gemma 3 270M's (0.782 -> 0.672), but its device check ran out of time
# drawing 8.6 GB of caches with numpy before the first point (now drawn on the device).
# (1) check_rope_kv_write: the device check, then CUPTI µs a layer; (2) bench_row_quant's
# splitk4096 site: FUSE_SPLITK_RESIDUAL's kernel checked against XLA's epilogue + add, µs a
# call; (3) the 8B FP8 step per kernel at 64 rows and 1 row with both switches on and with
# split-K alone (call 1's records are the off / RoPE-only runs of the same configuration).
#   OUT=... bash scripts/gpu_call_s26_c.sh
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
TAIL=24 run rkw 150 python3 -u benchmarks/kernels/check_rope_kv_write.py --out "$OUT/records/rkw"
TAIL=12 run rq 80 python3 -u benchmarks/kernels/bench_row_quant.py --sites splitk4096 \
  --ms 1,64 --variants w16s --out "$OUT/records/rq"
SK="--patch jaxinfer.models.transformer.FUSE_SPLITK_RESIDUAL=True"
RK="--patch jaxinfer.layers.pallas_attention.ROPE_KV_WRITE_KERNEL=True"
P8="python3 -u benchmarks/profile_decode.py --model dummy:llama-3.1-8b --backend pallas:fp8:fp8
  --ctx 512 --steps 10 --synthetic --top 14"
for b in 64 1; do
  # shellcheck disable=SC2086
  TAIL=17 run prof8-b$b-both 85 $P8 --batch $b $SK $RK --out "$OUT/records/prof8_b${b}_both"
  # shellcheck disable=SC2086
  TAIL=17 run prof8-b$b-splitk 85 $P8 --batch $b $SK --out "$OUT/records/prof8_b${b}_splitk"
done
