#!/usr/bin/env bash
# Session 36 (~150 s, either card; says which): the engine tests of prompt_kv, min_tokens and
# the research API on the GPU (Pallas attention, the GPU's programs), each engine seeing
# ~256 MiB of free device memory (scripts/pytest_small_pools.py: the tests build several
# engines a process, and each would size its pool to 0.9 of the device) and computing in
# float32 (scripts/pytest_float32.py: the greedy references are float32 arguments).
# Session 36 ran it without the float32 plugin (an H100: 34 passed, 4 min_tokens tests
# failed -- bf16 prefill-vs-decode rounding after the masked tokens), then the min_tokens
# tests with it (6 / 6 passed).
#   OUT=... bash scripts/gpu_call_s36_d.sh
set -u
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/nvidia-smi.txt"
JAX_PLATFORMS=cuda JAX_DEFAULT_MATMUL_PRECISION=highest PYTHONPATH=.:scripts timeout 240 \
  python3 -m pytest -q -p no:cacheprovider -p pytest_small_pools -p pytest_float32 -rfE \
  tests/models/test_prompt_kv.py tests/engine/test_min_tokens.py tests/models/test_research.py \
  tests/core/test_sampling_rows.py 2>&1 | tail -40 | tee "$OUT/gpu_pytest.txt"
