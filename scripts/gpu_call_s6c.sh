#!/usr/bin/env bash
# Session 6, call 4 (H200): the engine check of the Mosaic prefill path (pallas_mgpu, now the
# Hopper default, vs pallas vs reference; issue #3), the host profile of a 256-row decode step
# at 1024-token contexts with the bench suites' 272-page block tables (why the 1000/1000 step
# is ~2x its device time), and the 8B FP8-weight latency suite under async scheduling (#4).
#   OUT=... bash scripts/gpu_call_s6c.sh
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
TAIL=10 run check-mgpu-engine 190 python3 -u benchmarks/kernels/check_mgpu_engine.py \
  --out "$OUT/records"
TAIL=45 run profile-b256 170 python3 -u benchmarks/profile_decode.py --out "$OUT/records/prof" \
  --batch 256 --ctx 1024 --steps 10 --max-model-len 4352 --host-profile
# shellcheck disable=SC2086
run compile-fp8 120 $JI compile --model llama-3.1-8b $OPTS --quantization fp8 \
  --cache-dir /tmp/cache-fp8 --modes sample --jobs 14
# shellcheck disable=SC2086
TAIL=12 run L2-fp8 100 $JI bench latency --model llama-3.1-8b $OPTS --quantization fp8 \
  --cache-dir /tmp/cache-fp8 --out "$OUT/records" --prompt-lens 128,4096 \
  --concurrency 1,64 --input-len 128 --output-len 128
echo "packed $(du -h "$FINAL/results.tgz" | cut -f1)"
