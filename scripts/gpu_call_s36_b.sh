#!/usr/bin/env bash
# Session 36 call 2 (~430 s, an H200: the 70B run needs > 80 GB). First the research API's
# tests (prompt_kv, prompt_hidden_states, hooks) on the GPU against the HF fixtures -- the
# Pallas attention and the GPU's programs in place of the CPU's (matmul precision "highest",
# as the fixtures are float32) -- then session 34's call b at 160 sequences.
#   OUT=... bash scripts/gpu_call_s36_b.sh
set -u
mkdir -p "$OUT"
JAX_PLATFORMS=cuda JAX_DEFAULT_MATMUL_PRECISION=highest PYTHONPATH=. timeout 180 \
  python3 -m pytest -q -p no:cacheprovider tests/models/test_research.py \
  tests/models/test_prompt_kv.py tests/engine/test_min_tokens.py 2>&1 | tail -25 | tee "$OUT/research_gpu_pytest.txt"
NS=160 bash scripts/gpu_call_s34_b.sh
