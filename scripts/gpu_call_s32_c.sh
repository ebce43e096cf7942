#!/usr/bin/env bash
# Session 32 (prepared in session 31 as gpu_call_next_s32_70b.sh), ~590 s, an H200 (70B FP8
# needs > 80 GB). 1. The 70B A/B of session 31's 64-token GEMM tiles:
# Llama-3.1-70B FP8 weights + FP8 KV, k = 8, 64 x 1000 / 1000 offline (session 31 call 2:
# 1,656 tok/s, TPOT p50 33.5 ms) with the 64-token GEMM tiles of session 31 (the default)
# and with session 13's ($JAXINFER_FP8_DECODE_ROWS_AT_64=128), each compiled into its own
# cache (the switch is in the compile-cache fingerprint).
# 2. The device-only profile of the 8B FP8 + FP8-KV decode step at 512 rows x 1,536 tokens of
#    context (session 31 call 1's 1000 / 1000 x 512 run decoded at ~27.7 ms a step): device
#    busy per kernel class, to split that step into attention, GEMMs and the rest.
#   OUT=... [PROFILE=0 | DO_70B=0] bash scripts/gpu_call_s32_c.sh   (step 1 / step 2 only;
#   step 2 alone fits an H100: 8 GB of weights + 50 GB of FP8 KV pages)
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/logs/nvidia-smi.txt"
if [ "${DO_70B:-1}" = 1 ]; then
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.92  # 67 GiB of 70B FP8 weights + the KV pool
E70="--load-format dummy --model llama-3.1-70b --quantization fp8 --max-model-len 2048
  --max-num-seqs 64 --max-num-batched-tokens 8192 --max-prefill-seqs 8
  --prefill-buckets 1024,8192 --decode-buckets 8,32,64 --num-kv-pages 8448
  --kv-cache-dtype fp8 --num-scheduler-steps 8"
for rows in 64 128; do
  export JAXINFER_FP8_DECODE_ROWS_AT_64=$rows
  # shellcheck disable=SC2086  # option lists
  TAIL=3 run "compile-70b-rows$rows" 80 $JI compile $E70 --cache-dir /tmp/c70-$rows \
    --modes sample --jobs 14
  # shellcheck disable=SC2086
  TAIL=22 run "O-70b-rows$rows" 150 $JI bench offline --out "$OUT/records/rows$rows" \
    --time-limit 60 $E70 --cache-dir /tmp/c70-$rows --input-len 1000 --output-len 1000 \
    --num-prompts 64
done
summarize_offline "$OUT"/records/rows*/*.json
fi
unset JAXINFER_FP8_DECODE_ROWS_AT_64 XLA_PYTHON_CLIENT_MEM_FRACTION
[ "${PROFILE:-1}" = 0 ] || TAIL=40 run "profile-b512" 130 python3 -u benchmarks/profile_decode.py --out "$OUT/records/prof512" \
  --backend pallas:fp8:fp8 --batch 512 --ctx 1536 --steps 5 --synthetic --num-kv-pages 51200
