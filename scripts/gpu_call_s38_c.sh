#!/usr/bin/env bash
# Session 38 call c, prepared, not run (~280 s; either card, says which): the warm-up with
# `serve --warmup-prefill` also builds every prefill program (the Pallas path: 10 at the GPU
# defaults), so no prompt stalls the running streams while its bucket compiles. Opt-in until
# this measures its time and that 8 threads compiling prefill programs beside the KV pool do
# not run out of device memory (GEMM autotuning scratch); then it could be the GPU default.
# 1. the warm-up tests on the GPU (prefill set built, nothing compiled after; threads);
# 2. benchmarks/warmup_gpu.py, 8B bf16 at the defaults, 8 threads (session 38 calls a-b
#    measured the decode-only warm-up: 85.1 s with 8 threads, 270.3 s with one).
#   OUT=... bash scripts/gpu_call_s38_c.sh
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/logs/nvidia-smi.txt"
TAIL=8 run gpu-tests 70 env JAX_PLATFORMS=cuda PYTHONPATH="$PYTHONPATH:scripts" python3 -m pytest -q \
  -p no:cacheprovider -p pytest_small_pools -p pytest_float32 tests/engine/test_warmup.py \
  -k "prefill"
TAIL=12 run warmup-8b 260 python3 -u benchmarks/warmup_gpu.py --out "$OUT/records/warmup" \
  --model llama-3.1-8b --jobs 8 --child-timeout 250 --prefill
