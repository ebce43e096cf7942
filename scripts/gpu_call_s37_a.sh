#!/usr/bin/env bash
# Session 37 call a (~330 s; either card, says which): the logit_bias change on the GPU --
# the sampler-row / variant tests and the engine tests of min_tokens / allowed_token_ids /
# logit_bias (float32, small pools: scripts/pytest_*.py), then the sampler's device time with
# a full 300-entry bias table per row at vocab 128256, B 1 and 256 (sampling_cost.py, beside
# the penalties-only and temperature programs); on an H200 also session 34's prepared FP8-KV
# sweep (gpu_call_s34_a.sh: 512 rows x 1,536 tokens).
#   OUT=... bash scripts/gpu_call_s37_a.sh
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
GPU=$(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/logs/nvidia-smi.txt")
TAIL=12 run gpu-tests 240 env JAX_PLATFORMS=cuda PYTHONPATH="$PYTHONPATH:scripts" python3 -m pytest -q \
  -p no:cacheprovider -p pytest_small_pools -p pytest_float32 tests/engine/test_min_tokens.py \
  tests/core/test_sampling_rows.py tests/core/test_sampler_variants.py
TAIL=16 run sampling-cost 200 python3 benchmarks/sampling_cost.py --vocab 128256 --batches 1 256 \
  --mixes temperature penalties logit_bias penalties_logit_bias --modes variant \
  --out "$OUT/records/sampling_cost"
case "$GPU" in
  *H200*) TAIL=40 run fp8kv-b512 150 python3 -u benchmarks/kernels/bench_paged_fp8_sweep.py \
    --out "$OUT/records/b512" --shapes 512x1536,128x2048 --deadline-s 120 ;;
esac
