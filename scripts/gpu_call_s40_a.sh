#!/usr/bin/env bash
# Session 40 call a (~250 s; either card, says which): the stall of a new sampler variant
# under multi-step decode, before and after 42a4b21 (its k-step program built on a background
# thread while its windows run as one step), and this session's engine changes on the GPU.
# 1. GPU tests: the multi-step background build, the research API (hooks with positions /
#    hook_args, a NaN hook) and the reference-attention NaN tests;
# 2. benchmarks/variant_stall.py: Llama-3.1-8B FP8 (random weights), k = 8, 8 greedy streams
#    after the warm-up, a top-p request at step 10; inline (the old rule) vs background,
#    each in a fresh process.
#   OUT=... bash scripts/gpu_call_s40_a.sh
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/logs/nvidia-smi.txt"
TAIL=6 run gpu-tests 150 env JAX_PLATFORMS=cuda PYTHONPATH="$PYTHONPATH:scripts" python3 -m pytest -q \
  -p no:cacheprovider -p pytest_small_pools -p pytest_float32 \
  tests/engine/test_multi_step.py -k "unbuilt or without_built or research or unread" \
  tests/models/test_research.py tests/kernels/test_reference_unread.py
TAIL=8 run variant-stall 300 python3 benchmarks/variant_stall.py --out "$OUT/records/stall" \
  --quantization fp8 --k 8 --streams 8 --decode-buckets 8,16
