#!/usr/bin/env bash
# Session 6 (H200): the Mosaic GPU varlen prefill after its module-level jit and per-bucket
# routing (issue #3): `jaxinfer compile` (8B bf16, the session 5 options; compile time per prefill
# program, was ~103 s with pallas_mgpu vs ~33 s with pallas) and TTFT at 128 / 1024 / 4096
# tokens, pallas (Triton) vs pallas_mgpu (Triton below MGPU_MIN_TOKENS = 1024, the Mosaic
# kernel with its lax.cond fallback at and above); last the kernel candidates checked against
# the reference and timed (bench_prefill_mgpu.py: the jitted paged_prefill_attention_mgpu with
# a traced layer). Output packed into $OUT/results.tgz.
#   OUT=... bash scripts/gpu_call_s6_mgpu.sh
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
# shellcheck disable=SC2086
for be in pallas pallas_mgpu; do
  run compile-$be 120 $JI compile --model llama-3.1-8b $OPTS --attention-backend $be \
    --cache-dir /tmp/cache-$be --modes sample --jobs 14 -v
  TAIL=8 run TTFT-$be 90 $JI bench latency --model llama-3.1-8b $OPTS --attention-backend $be \
    --cache-dir /tmp/cache-$be --out "$OUT/records" --prompt-lens 128,1024,4096 --repeats 5 \
    --concurrency 1 --input-len 128 --output-len 32
done
# last: the kernel check may run into a 600 s call limit (then split it into its own call)
TAIL=20 run prefill-mgpu-kernel 200 python3 -u benchmarks/kernels/bench_prefill_mgpu.py \
  --out "$OUT/records/prefill_mgpu" --deadline-s 185
echo "packed $(du -h "$FINAL/results.tgz" | cut -f1)"
