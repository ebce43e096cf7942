#!/usr/bin/env bash
# Next session (H200, ~420 s of a 600 s limit; prepared in session 24, not run: no device was
# lent for it): the o / down GEMMs' split-K partials summed inside the next norm_quant_fp8
# with the residual add (jaxinfer.models.transformer.FUSE_SPLITK_RESIDUAL, off until timed;
# removes XLA's epilogue + add fusions, 2 a layer). (1) bench_row_quant's splitk4096 site:
# device check against XLA's epilogue + add then the kernel, CUPTI µs a call at 1 / 64 rows;
# (2) the 8B decode step per kernel (FP8 weights + FP8 KV, ctx 512), 64 rows and 1 row: off,
# on, and on together with the RoPE + KV write kernel (ROPE_KV_WRITE_KERNEL, see
# gpu_call_s26_a.sh). Adopt what lowers device busy at both row counts.
#   OUT=... bash scripts/gpu_call_s26_b.sh
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
TAIL=12 run rq 80 python3 -u benchmarks/kernels/bench_row_quant.py --sites splitk4096 \
  --ms 1,64 --variants w16s --out "$OUT/records/rq"
SK="--patch jaxinfer.models.transformer.FUSE_SPLITK_RESIDUAL=True"
RK="--patch jaxinfer.layers.pallas_attention.ROPE_KV_WRITE_KERNEL=True"
P8="python3 -u benchmarks/profile_decode.py --model dummy:llama-3.1-8b --backend pallas:fp8:fp8
  --ctx 512 --steps 10 --synthetic --top 14"
for b in 64 1; do
  # shellcheck disable=SC2086
  TAIL=17 run prof8-b$b-splitk 85 $P8 --batch $b $SK --out "$OUT/records/prof8_b${b}_splitk"
  # shellcheck disable=SC2086
  TAIL=17 run prof8-b$b-both 85 $P8 --batch $b $SK $RK --out "$OUT/records/prof8_b${b}_both"
  # shellcheck disable=SC2086
  TAIL=17 run prof8-b$b-off 85 $P8 --batch $b --out "$OUT/records/prof8_b${b}_off"
done
