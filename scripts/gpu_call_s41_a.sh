#!/usr/bin/env bash
# Session 41 call a (meant for an H200, runs on either card -- say which; ~260 s):
# 1. session 34's FP8-KV decode sweep at 512 rows x 1,536 tokens (scripts/gpu_call_s34_a.sh);
# 2. the research tests and the float32-precision program tests on the GPU *without*
#    JAX_DEFAULT_MATMUL_PRECISION: since this session float32 models trace their dots at
#    precision "highest" themselves (models/transformer.matmul_precision), so the float32
#    engine meets HF's float32 hidden states to 1e-4 (session 40 needed the variable).
#   OUT=... bash scripts/gpu_call_s41_a.sh
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/logs/nvidia-smi.txt"
TAIL=12 run gpu-tests 200 env JAX_PLATFORMS=cuda \
  PYTHONPATH="$PYTHONPATH:scripts" python3 -m pytest -q -p no:cacheprovider -p pytest_small_pools \
  -p pytest_float32 tests/models/test_research.py tests/engine/test_step_programs.py
TAIL=40 run fp8kv-b512 150 python3 -u benchmarks/kernels/bench_paged_fp8_sweep.py \
  --out "$OUT/records/b512" --shapes 512x1536,128x2048 --deadline-s 120
