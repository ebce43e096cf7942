#!/usr/bin/env bash
# Session 9, H200: 8B FP8 latency sweep with the session-9 defaults (FP8 middle band on the
# Mosaic GPU kernels, the in-kernel split merge at batch 1): TTFT at 128 / 1024 / 4096-token
# prompts, 1 / 16 / 64 / 128 streams of 128 / 128 tokens.
#   OUT=... bash scripts/gpu_call_s9_fp8_lat.sh
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
ENG="--model llama-3.1-8b $OPTS --quantization fp8"
# shellcheck disable=SC2086
TAIL=3 run compile-fp8 100 $JI compile $ENG --cache-dir /tmp/c-fp8 --modes sample --jobs 14
# shellcheck disable=SC2086
TAIL=12 run L2-fp8 110 $JI bench latency $ENG --cache-dir /tmp/c-fp8 --out "$OUT/records" \
  --prompt-lens 128,1024,4096 --concurrency 1,16,64,128 --input-len 128 --output-len 128
