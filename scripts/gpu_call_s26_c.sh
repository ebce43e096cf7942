#!/usr/bin/env bash
# Session 26, call 2 (H200, ~550 s): call 1 (gpu_call_s26_a.sh) showed the RoPE + KV write
# kernel lowering the 8B FP8 step's device busy at 64 rows (4.209 -> 4.113 ms) and 1 row
# (2.809 -> 2.719) and Gemma 3 270M's (0.782 -> 0.672), but its device check ran out of time
# drawing 8.6 GB of caches with numpy before the first point (now drawn on the device).
# (1) check_rope_kv_write: the device check, then CUPTI µs a layer; (2) the engine end to end
# on the 8B shape, FP8 weights + FP8 KV, batch 1 and 64, the kernel on, beside the
# torch.compile peer; (3) bench_row_quant's splitk4096 site: FUSE_SPLITK_RESIDUAL's kernel
# checked against XLA's epilogue + add, µs a call; (4) the 8B FP8 step per kernel at 64 rows
# and 1 row with both switches on (call 1's records are the off / RoPE-only runs).
#   OUT=... bash scripts/gpu_call_s26_c.sh
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
SK="--patch jaxinfer.models.transformer.FUSE_SPLITK_RESIDUAL=True"
RK="--patch jaxinfer.layers.pallas_attention.ROPE_KV_WRITE_KERNEL=True"
TAIL=24 run rkw 130 python3 -u benchmarks/kernels/check_rope_kv_write.py --out "$OUT/records/rkw"
# shellcheck disable=SC2086
TAIL=10 run e2e8-rope 230 python3 -u benchmarks/gpu_decode.py --batches 1 64 --steps 32 \
  --backends pallas:fp8:fp8 --budget-s 200 --quick --peer .peers/torch_compile_llama.py $RK \
  --out "$OUT/records/e2e8_rope"
TAIL=12 run rq 70 python3 -u benchmarks/kernels/bench_row_quant.py --sites splitk4096 \
  --ms 1,64 --variants w16s --out "$OUT/records/rq"
P8="python3 -u benchmarks/profile_decode.py --model dummy:llama-3.1-8b --backend pallas:fp8:fp8
  --ctx 512 --steps 10 --synthetic --top 14"
for b in 64 1; do
  # shellcheck disable=SC2086
  TAIL=17 run prof8-b$b-both 80 $P8 --batch $b $SK $RK --out "$OUT/records/prof8_b${b}_both"
done
grep -H -o '"tpot_ms_[a-z]*": [0-9.]*' "$OUT"/logs/e2e8*.log
