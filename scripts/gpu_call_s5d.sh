#!/usr/bin/env bash
# Session 5, device call 4 (H200): `jaxinfer compile` of the 8B FP8 bucket set (phases, end to
# end) and of the 70B FP8 shape with the same engine options (compile time vs depth); TTFT with
# the Mosaic GPU varlen prefill (--attention-backend pallas_mgpu) beside the Triton prefill in
# the same call. Output packed into $OUT/results.tgz.
#   OUT=... bash scripts/gpu_call_s5d.sh
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
# shellcheck disable=SC2086
for m in 8b 70b; do
  run compile-fp8-$m 150 $JI compile --model llama-3.1-$m $OPTS --quantization fp8 \
    --cache-dir /tmp/cache-fp8-$m --modes sample --jobs 14 -v
done
# shellcheck disable=SC2086
for be in pallas pallas_mgpu; do
  run compile-$be 120 $JI compile --model llama-3.1-8b $OPTS --attention-backend $be \
    --cache-dir /tmp/cache-$be --modes sample --jobs 14
  TAIL=8 run TTFT-$be 90 $JI bench latency --model llama-3.1-8b $OPTS --attention-backend $be \
    --cache-dir /tmp/cache-$be --out "$OUT/records" --prompt-lens 128,1024,4096 --repeats 5 \
    --concurrency 1 --input-len 128 --output-len 32
done
echo "packed $(du -h "$FINAL/results.tgz" | cut -f1)"
