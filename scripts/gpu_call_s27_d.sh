#!/usr/bin/env bash
# Session 27, call 2 (~190 s: the device time left after ~16 min of machines that did not
# start; not run either -- session 28's gpu_call_s28_a.sh covers it): the 8B shape, FP8
# weights + FP8 KV, the RoPE kernel on,
# batch 1, beside the torch.compile peer in the same process: multi-step k=8 with pipelined
# windows (engine_multi.py) vs one step a program.
#   OUT=... bash scripts/gpu_call_s27_d.sh
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
RK="--patch jaxinfer.layers.pallas_attention.ROPE_KV_WRITE_KERNEL=True"
# shellcheck disable=SC2086
TAIL=10 run e2e8 180 python3 -u benchmarks/gpu_decode.py --batches 1 --steps 64 \
  --backends pallas:fp8:fp8/ms8 pallas:fp8:fp8 --budget-s 160 --quick \
  --peer .peers/torch_compile_llama.py $RK --out "$OUT/records/e2e8"
grep -H -o '"tpot_ms_[a-z_]*": [0-9.]*\|"[a-z_]*_windows": [0-9]*' "$OUT"/logs/e2e8*.log
