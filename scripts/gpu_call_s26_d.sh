#!/usr/bin/env bash
# Session 26, call 3 (H200, ~230 s: the device budget left after a machine stopped answering
# during call 2, gpu_call_s26_c.sh, which returned nothing): the engine end to end on the 8B
# shape, FP8 weights + FP8 KV, the RoPE + KV write kernel on, batch 1: multi-step decode
# (num_scheduler_steps 8) then one step a program, in one process (no peer: no time for it).
#   OUT=... bash scripts/gpu_call_s26_d.sh
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
TAIL=10 run e2e8 215 python3 -u benchmarks/gpu_decode.py --batches 1 --steps 32 \
  --backends pallas:fp8:fp8/ms8 pallas:fp8:fp8 --budget-s 190 --quick --peer "" \
  --patch jaxinfer.layers.pallas_attention.ROPE_KV_WRITE_KERNEL=True --out "$OUT/records/e2e8"
grep -H -o '"tpot_ms_[a-z_]*": [0-9.]*\|"multi_step_windows": [0-9]*' "$OUT"/logs/e2e8*.log
