#!/usr/bin/env bash
# Session 9, H200: the FP8 middle band (128 / 256-row decode buckets, 128-token prefill
# bucket) on the Mosaic GPU W8A8 kernels (the new default, pallas_kernels/matmul/api.py) end
# to end against XLA W8A16 there ($JAXINFER_FP8_MID_GEMM=xla, the previous plan): 8B FP8,
# the bench suites' engine options; offline 1,024 x 128/128 (256-row decode steps) and
# 128 streams of 128/128 (latency), each choice compiled into its own cache.
#   OUT=... bash scripts/gpu_call_s9_fp8_mid.sh
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
ENG="--model llama-3.1-8b $OPTS --quantization fp8"
for mid in mgpu xla; do
  export JAXINFER_FP8_MID_GEMM=$mid
  # shellcheck disable=SC2086
  TAIL=6 run compile-$mid 150 $JI compile $ENG --cache-dir /tmp/c-$mid --modes sample --jobs 14
  # shellcheck disable=SC2086
  TAIL=12 run offline-$mid 100 $JI bench offline $ENG --cache-dir /tmp/c-$mid \
    --out "$OUT/records" --input-len 128 --output-len 128 --num-prompts 1024 --time-limit 60
  # shellcheck disable=SC2086
  TAIL=8 run latency-$mid 80 $JI bench latency $ENG --cache-dir /tmp/c-$mid \
    --out "$OUT/records" --prompt-lens 128 --concurrency 128 --input-len 128 --output-len 128
done
