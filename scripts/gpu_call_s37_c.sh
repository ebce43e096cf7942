#!/usr/bin/env bash
# Session 37 call c (~200 s; either card, says which): the logit_bias behind its own sampler
# flag (variants temperature_bias, top_k_top_p_full_bias), so that batches without a bias run
# the programs they ran before -- the sampler's device time as in calls a and b (vocab 128256,
# B 1 and 256, with a kernel breakdown at 256), then the sampler-row / variant / engine tests
# on the GPU again.
#   OUT=... bash scripts/gpu_call_s37_c.sh
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/logs/nvidia-smi.txt"
TAIL=16 run sampling-cost 200 python3 benchmarks/sampling_cost.py --vocab 128256 --batches 1 256 \
  --mixes temperature penalties logit_bias penalties_logit_bias --modes variant \
  --breakdown logit_bias:256 penalties:256 --out "$OUT/records/sampling_cost"
TAIL=12 run gpu-tests 240 env JAX_PLATFORMS=cuda PYTHONPATH="$PYTHONPATH:scripts" python3 -m pytest -q \
  -p no:cacheprovider -p pytest_small_pools -p pytest_float32 tests/engine/test_min_tokens.py \
  tests/core/test_sampling_rows.py tests/core/test_sampler_variants.py
