#!/usr/bin/env bash
# Prepared in session 28 for the next device call (~400 s, H100 or H200): (1) the RoPE + KV
# write check and CUPTI times, now with a 128-token point (ROPE_KV_WRITE_MAX_TOKENS is 64 by
# interpolation); (2) the 8B FP8 / FP8-KV engine end to end, kernel on (the default since
# session 28) vs off, batch 1 and 64, one step a program, on one machine and without the
# peer (session 28's A/B ran past its limit because the peer ran in each); (3) the peer
# once, beside the default engine (multi-step k = 8, pipelined) at batch 1.
#   OUT=... bash scripts/gpu_call_s29_a.sh
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
TAIL=24 run rkw 110 python3 -u benchmarks/kernels/check_rope_kv_write.py --out "$OUT/records/rkw"
for rk in True False; do
  TAIL=6 run "e2e8-rk$rk" 120 python3 -u benchmarks/gpu_decode.py --batches 1 64 --steps 64 \
    --backends pallas:fp8:fp8 --budget-s 110 --quick --peer "" \
    --patch "jaxinfer.layers.pallas_attention.ROPE_KV_WRITE_KERNEL=$rk" \
    --out "$OUT/records/e2e8_rk$rk"
done
TAIL=6 run e2e8-ms8-peer 150 python3 -u benchmarks/gpu_decode.py --batches 1 --steps 64 \
  --backends pallas:fp8:fp8/ms8 --budget-s 140 --quick \
  --peer .peers/torch_compile_llama.py --out "$OUT/records/e2e8_ms8_peer"
grep -H -o '"tpot_ms_[a-z_]*": [0-9.]*' "$OUT"/logs/e2e8*.log
