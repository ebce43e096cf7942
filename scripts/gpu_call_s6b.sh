#!/usr/bin/env bash
# Session 6, call 3 (H200): the Pallas sampling search kernel (issue #7: checked against the jnp
# search, then timed; the sampler variants with --search-impl jnp,pallas and the sort buffer),
# the engine check of the Mosaic prefill path (pallas_mgpu vs pallas vs reference, issue #3),
# and the FP8 KV decode sweep (issue #3). Output packed into $OUT/results.tgz.
#   OUT=... bash scripts/gpu_call_s6b.sh
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
TAIL=16 run sampling-search 85 python3 -u benchmarks/kernels/bench_sampling_search.py \
  --out "$OUT/records" --deadline-s 70
TAIL=16 run sampling-cost 90 python3 -u benchmarks/sampling_cost.py --out "$OUT/records" \
  --modes variant --mixes top_p top_k_top_p all --batches 1 256 --iters 10 --trace-iters 5 \
  --step-ms-b1 4.8 --step-ms-b256 16 --buffer-method sort --search-impl jnp,pallas
TAIL=10 run check-mgpu-engine 100 python3 -u benchmarks/kernels/check_mgpu_engine.py \
  --out "$OUT/records"
TAIL=40 run fp8kv-sweep 215 python3 -u benchmarks/kernels/bench_paged_fp8_sweep.py \
  --out "$OUT/records"
echo "packed $(du -h "$FINAL/results.tgz" | cut -f1)"
