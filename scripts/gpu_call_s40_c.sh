#!/usr/bin/env bash
# Session 40 call c (either card): this session's GPU tests as session 36 ran the research
# ones (matmul precision "highest": the HF fixtures are float32; TF32 GEMMs miss 1e-4).
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/logs/nvidia-smi.txt"
TAIL=12 run gpu-tests 200 env JAX_PLATFORMS=cuda JAX_DEFAULT_MATMUL_PRECISION=highest \
  PYTHONPATH="$PYTHONPATH:scripts" python3 -m pytest -q -p no:cacheprovider -p pytest_small_pools \
  -p pytest_float32 tests/models/test_research.py tests/kernels/test_reference_unread.py \
  "tests/engine/test_multi_step.py::test_an_unbuilt_variant_runs_one_step_while_its_program_builds" \
  "tests/engine/test_multi_step.py::test_without_built_one_step_programs_a_window_builds_its_program_at_once"
