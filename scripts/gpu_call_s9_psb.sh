#!/usr/bin/env bash
# Session 9, H200: (1) paged decode at small batch, merge='xla' vs the in-kernel merge vs the
# stock kernel (benchmarks/kernels/bench_paged_small_batch.py, NOTES_paged_attention); (2) 8B
# FP8 offline 1000/1000 (512 prompts, the peers' table's workload) with the session-9 FP8
# plan (middle band on the Mosaic GPU kernels).
#   OUT=... bash scripts/gpu_call_s9_psb.sh
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
TAIL=40 run psb 170 python3 benchmarks/kernels/bench_paged_small_batch.py --out "$OUT/records/psb"
ENG="--model llama-3.1-8b $OPTS --quantization fp8"
# shellcheck disable=SC2086
TAIL=4 run compile-fp8 150 $JI compile $ENG --cache-dir /tmp/c-fp8 --modes sample --jobs 14
# shellcheck disable=SC2086
TAIL=14 run O4-fp8 110 $JI bench offline $ENG --cache-dir /tmp/c-fp8 --out "$OUT/records" \
  --input-len 1000 --output-len 1000 --num-prompts 512 --time-limit 75
