#!/usr/bin/env bash
# Session 39 call a (~200 s; either card, says which): bad_words on the GPU.
# 1. the bad-words tests and the sampler-variant equality test on the GPU;
# 2. the sampler's cost with bad words: benchmarks/sampling_cost.py, mixes logit_bias (a full
#    300-entry table), bad_words (a full 128 x 16-token table per row), temperature and
#    greedy at B 1 and 256, vocab 128256, the runner's variant programs -- ours, then the
#    sampler of 110c6a0~1 (before bad words: no bad-words stage, the tables not returned)
#    in the same process, mode file-variant (the snapshot holds it, not git: `git show
#    110c6a0~1:jaxinfer/sampling.py > .peers/sampling_before_bad_words.py`).
#   OUT=... bash scripts/gpu_call_s39_a.sh
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/logs/nvidia-smi.txt"
TAIL=6 run gpu-tests 150 env JAX_PLATFORMS=cuda PYTHONPATH="$PYTHONPATH:scripts" python3 -m pytest -q \
  -p no:cacheprovider -p pytest_small_pools -p pytest_float32 tests/core/test_bad_words.py \
  tests/engine/test_bad_words_engine.py tests/core/test_sampler_variants.py
MIXES="greedy temperature logit_bias bad_words"
TAIL=12 run sampling-cost 150 python3 benchmarks/sampling_cost.py --mixes $MIXES \
  --out "$OUT/records/sampling"
TAIL=12 run sampling-cost-before 150 python3 benchmarks/sampling_cost.py --mixes $MIXES \
  --modes variant --sampler-file .peers/sampling_before_bad_words.py \
  --out "$OUT/records/sampling_before"
