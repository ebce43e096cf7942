#!/usr/bin/env bash
# Session 36 (~420 s, either card; says which): the research API's tests on the GPU (as in
# gpu_call_s36_b.sh), then session 34's call c (512-row step profiles with SM clock / power).
#   OUT=... bash scripts/gpu_call_s36_c.sh
set -u
mkdir -p "$OUT"
JAX_PLATFORMS=cuda JAX_DEFAULT_MATMUL_PRECISION=highest PYTHONPATH=. timeout 180 \
  python3 -m pytest -q -p no:cacheprovider tests/models/test_research.py \
  tests/models/test_prompt_kv.py tests/engine/test_min_tokens.py 2>&1 | tail -25 | tee "$OUT/research_gpu_pytest.txt"
bash scripts/gpu_call_s34_c.sh
