#!/usr/bin/env bash
# Session 28, call 3 (~330 s): (1) check_rope_kv_write with its reference compiled without
# XLA's excess precision (call 2: the kernel equals the CPU reference; XLA's default path
# skips bf16 roundings); (2) the 8B shape, FP8 weights + FP8 KV, one step a program, batch 1
# and 64: the RoPE + KV write kernel on vs off (ROPE_KV_WRITE_KERNEL), same machine.
#   OUT=... bash scripts/gpu_call_s28_c.sh
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
TAIL=22 run rkw 100 python3 -u benchmarks/kernels/check_rope_kv_write.py --out "$OUT/records/rkw"
for rk in True False; do
  TAIL=6 run "e2e8-rk$rk" 110 python3 -u benchmarks/gpu_decode.py --batches 1 64 --steps 64 \
    --backends pallas:fp8:fp8 --budget-s 100 --quick \
    --patch "jaxinfer.layers.pallas_attention.ROPE_KV_WRITE_KERNEL=$rk" \
    --out "$OUT/records/e2e8_rk$rk"
done
grep -H -o '"tpot_ms_[a-z_]*": [0-9.]*' "$OUT"/logs/e2e8*.log
