#!/usr/bin/env bash
# Session 5, device call 3 (H200): the bf16 8B suite's compile (-v phases) and offline
# 128/128 + 1000/1000 with async scheduling (the default now); TTFT with the Triton prefill
# kernel vs the Mosaic GPU varlen prefill kernel (--attention-backend pallas_mgpu, its own
# cache); the sampler variants at B=1/256. Output packed into $OUT/results.tgz.
#   OUT=... bash scripts/gpu_call_s5.sh
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
LIMIT=60 COMPILE_EXTRA=-v bash scripts/bench_h200.sh bf16-offline; pack
ENGINE="--model llama-3.1-8b $OPTS"
# shellcheck disable=SC2086
run TTFT-triton 90 $JI bench latency $ENGINE --cache-dir /tmp/jaxinfer-cache-bf16 \
  --out "$OUT/records" --prompt-lens 1024,4096 --concurrency 1 --input-len 128 --output-len 32
# shellcheck disable=SC2086
run compile-mgpu 120 $JI compile $ENGINE --attention-backend pallas_mgpu \
  --cache-dir /tmp/jaxinfer-cache-mgpu --modes sample --jobs 14 -v
# shellcheck disable=SC2086
run TTFT-mgpu 90 $JI bench latency $ENGINE --attention-backend pallas_mgpu \
  --cache-dir /tmp/jaxinfer-cache-mgpu --out "$OUT/records" --prompt-lens 1024,4096 \
  --concurrency 1 --input-len 128 --output-len 32
run sampling 120 python3 -u benchmarks/sampling_cost.py --out "$OUT/records" --modes variant \
  --batches 1 256 --iters 10 --trace-iters 5 --step-ms-b1 4.76 --step-ms-b256 18.5
echo "packed $(du -h "$FINAL/results.tgz" | cut -f1)"
