#!/usr/bin/env bash
# Session 10, call 3 (H200): end to end, the Triton FP8 decode GEMM's split-K merged in the
# kernel ("merge") against the XLA epilogue fusion ("none"), both with the engine's new FP8
# gate_up form (SwiGLU in the GEMM's epilogue / its epilogue fusion). Call 2 measured the
# in-kernel activation quantization ("all") 1.4-3.5x slower per GEMM: not run here.
# 8B FP8, random weights, decode buckets 1 / 16 / 64, 128-token prompts, 128 output tokens.
#   OUT=... bash scripts/gpu_call_s10_fuse_e2e.sh
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
ENG="--model llama-3.1-8b $OPTS --quantization fp8 --max-num-seqs 64 --decode-buckets 1,16,64
  --prefill-buckets 128,1024 --max-num-batched-tokens 1024 --max-prefill-seqs 16"
for fuse in merge none; do
  export JAXINFER_FP8_DECODE_FUSE=$fuse
  # shellcheck disable=SC2086
  TAIL=3 run compile-$fuse 120 $JI compile $ENG --cache-dir /tmp/c-$fuse --modes sample --jobs 14
  # shellcheck disable=SC2086
  TAIL=10 run latency-$fuse 120 $JI bench latency $ENG --cache-dir /tmp/c-$fuse \
    --out "$OUT/records" --prompt-lens 128 --concurrency 1,16,64 --input-len 128 --output-len 128
done
