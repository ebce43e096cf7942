#!/usr/bin/env bash
# Session 41 call a (either card; ~330 s, ~480 s on an H200 -- say which card):
# 1. the research tests and the float32-precision program tests on the GPU *without*
#    JAX_DEFAULT_MATMUL_PRECISION: since this session float32 models trace their dots at
#    precision "highest" themselves (models/transformer.matmul_precision), so the float32
#    engine meets HF's float32 hidden states to 1e-4 (session 40 needed the variable);
# 2. the stall of a first top-p request under multi-step decode (session 40 call b's command)
#    with the GC heap frozen after the warm-up, as InferenceServer.start now does, against
#    session 40's server (background_unfrozen);
# 3. on an H200 only: session 34's FP8-KV decode sweep at 512 rows x 1,536 tokens
#    (scripts/gpu_call_s34_a.sh).
#   OUT=... bash scripts/gpu_call_s41_a.sh
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/logs/nvidia-smi.txt"
TAIL=12 run gpu-tests 150 env JAX_PLATFORMS=cuda \
  PYTHONPATH="$PYTHONPATH:scripts" python3 -m pytest -q -p no:cacheprovider -p pytest_small_pools \
  -p pytest_float32 tests/models/test_research.py tests/engine/test_step_programs.py
TAIL=8 run variant-stall 260 python3 benchmarks/variant_stall.py --out "$OUT/records/stall" \
  --quantization fp8 --k 8 --streams 8 --decode-buckets 8,16 \
  --modes background,background_unfrozen
if grep -q H200 "$OUT/logs/nvidia-smi.txt"; then
  TAIL=40 run fp8kv-b512 150 python3 -u benchmarks/kernels/bench_paged_fp8_sweep.py \
    --out "$OUT/records/b512" --shapes 512x1536,128x2048 --deadline-s 120
fi
