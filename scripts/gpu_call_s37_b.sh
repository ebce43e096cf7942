#!/usr/bin/env bash
# Session 37 call b (~120 s; either card, says which): the logit_bias written over the
# penalized logits (no copy of the raw logits) -- the sampler-row / variant / engine tests on
# the GPU again, then the sampler's device time as in call a (vocab 128256, B 1 and 256).
#   OUT=... bash scripts/gpu_call_s37_b.sh
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/logs/nvidia-smi.txt"
TAIL=16 run sampling-cost 200 python3 benchmarks/sampling_cost.py --vocab 128256 --batches 1 256 \
  --mixes temperature penalties logit_bias penalties_logit_bias --modes variant \
  --out "$OUT/records/sampling_cost"
TAIL=12 run gpu-tests 240 env JAX_PLATFORMS=cuda PYTHONPATH="$PYTHONPATH:scripts" python3 -m pytest -q \
  -p no:cacheprovider -p pytest_small_pools -p pytest_float32 tests/engine/test_min_tokens.py \
  tests/core/test_sampling_rows.py tests/core/test_sampler_variants.py
