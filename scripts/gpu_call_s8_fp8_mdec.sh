#!/usr/bin/env bash
# Next session (H200): the opt-in Mosaic GPU swap-AB decode GEMM for FP8 rows 17..64
# ($JAXINFER_FP8_DECODE_GEMM=mgpu, pallas_kernels/matmul/api.py) end to end against the
# default Triton W8A8 kernel: 8B FP8, the bench suites' engine options, compile time of each
# bucket set and 32 / 64 streams of 128 / 128 tokens. NOTES_matmul "The H200 runs (session 7)"
# has the kernel-level figures (1.34-1.51x the Triton kernel at M = 64).
#   OUT=... bash scripts/gpu_call_s8_fp8_mdec.sh
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
ENG="--model llama-3.1-8b $OPTS --quantization fp8"
declare -A CSECS=([triton]=150 [mgpu]=200)  # whole call <= 570 s (the device's 600 s limit)
for gemm in triton mgpu; do
  export JAXINFER_FP8_DECODE_GEMM=$gemm
  # shellcheck disable=SC2086
  TAIL=6 run compile-$gemm "${CSECS[$gemm]}" $JI compile $ENG --cache-dir /tmp/c-$gemm --modes sample --jobs 14
  # shellcheck disable=SC2086
  TAIL=12 run latency-$gemm 110 $JI bench latency $ENG --cache-dir /tmp/c-$gemm \
    --out "$OUT/records" --prompt-lens 128 --concurrency 1,32,64 --input-len 128 --output-len 128
done
