#!/usr/bin/env bash
# Session 28, call 1 (~570 s; prepared in session 27 as gpu_call_s27_c.sh, which never ran:
# no machine started; removed as this copy's duplicate).
# (1) check_rope_kv_write with the donated caches carried through CUPTI (call 1 passed its
# first point -- the session-26 hang is gone -- then JAX's profiler.measure refused the
# donated arrays); (2) the engine end to end on the 8B shape, FP8 weights + FP8 KV, the RoPE
# kernel on, beside the torch.compile peer in the same process: multi-step k=8 with windows
# now pipelined (engine_multi.py) at batch 1 and 64, then one step a program at batch 1;
# (3) FUSE_SPLITK_RESIDUAL in the 8B FP8 decode step at 64 rows, on vs off (device busy).
#   OUT=... bash scripts/gpu_call_s28_a.sh
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
TAIL=24 run rkw 100 python3 -u benchmarks/kernels/check_rope_kv_write.py --out "$OUT/records/rkw"
RK="--patch jaxinfer.layers.pallas_attention.ROPE_KV_WRITE_KERNEL=True"
# shellcheck disable=SC2086
TAIL=10 run e2e8 290 python3 -u benchmarks/gpu_decode.py --batches 1 64 --steps 64 \
  --backends pallas:fp8:fp8/ms8 pallas:fp8:fp8 --budget-s 270 --quick \
  --peer .peers/torch_compile_llama.py $RK --out "$OUT/records/e2e8"
grep -H -o '"tpot_ms_[a-z_]*": [0-9.]*\|"[a-z_]*_windows": [0-9]*' "$OUT"/logs/e2e8*.log
SK="--patch jaxinfer.models.transformer.FUSE_SPLITK_RESIDUAL=True"
P8="python3 -u benchmarks/profile_decode.py --model dummy:llama-3.1-8b --backend pallas:fp8:fp8
  --ctx 512 --steps 10 --synthetic --top 14 --batch 64"
# shellcheck disable=SC2086
TAIL=17 run prof8-b64-sk 75 $P8 $RK $SK --out "$OUT/records/prof8_b64_sk"
# shellcheck disable=SC2086
TAIL=17 run prof8-b64-base 75 $P8 $RK --out "$OUT/records/prof8_b64_base"
grep -H "busy\|span" "$OUT"/logs/prof8*.log | cut -c1-160
