#!/usr/bin/env bash
# Session 28, call 4 (~230 s): the RoPE + KV write kernel on vs off in the 8B decode step
# (FP8 weights + FP8 KV, ctx 512), batch 1 and 64, device-only profiles on one machine
# (call 3's end-to-end A/B ran out of its time limit: the peer ran in each).
#   OUT=... bash scripts/gpu_call_s28_d.sh
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
P8="python3 -u benchmarks/profile_decode.py --model dummy:llama-3.1-8b --backend pallas:fp8:fp8
  --ctx 512 --steps 10 --synthetic --top 12"
for b in 1 64; do
  for rk in True False; do
    # shellcheck disable=SC2086
    TAIL=3 run "prof8-b$b-rk$rk" 60 $P8 --batch $b \
      --patch "jaxinfer.layers.pallas_attention.ROPE_KV_WRITE_KERNEL=$rk" \
      --out "$OUT/records/prof8_b${b}_rk$rk"
  done
done
grep -H "busy" "$OUT"/logs/prof8*.log | cut -c1-200
