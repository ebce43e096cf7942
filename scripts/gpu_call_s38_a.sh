#!/usr/bin/env bash
# Session 38 call a (~420 s; either card, says which): the GPU batch defaults (256 sequences,
# 8192 prefill tokens; engine_config.GPU_DEFAULTS) and the threaded warm-up (warmup.py).
# 1. tests/engine/test_warmup.py on the GPU (threads building programs beside a request,
#    counts, GPU default resolution), float32 engines, small pools;
# 2. benchmarks/warmup_gpu.py: 8B bf16 engine at the defaults, `warm_up` with 1 thread and
#    with 8, each in a fresh process, then 64 greedy requests (no decode program may compile
#    after warm-up; request 0's first tokens equal across the two);
# 3. on an H200, session 34's prepared FP8-KV sweep point (512 rows x 1,536 tokens).
#   OUT=... bash scripts/gpu_call_s38_a.sh
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
GPU=$(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/logs/nvidia-smi.txt")
TAIL=8 run gpu-tests 120 env JAX_PLATFORMS=cuda PYTHONPATH="$PYTHONPATH:scripts" python3 -m pytest -q \
  -p no:cacheprovider -p pytest_small_pools -p pytest_float32 tests/engine/test_warmup.py
TAIL=12 run warmup-8b 330 python3 -u benchmarks/warmup_gpu.py --out "$OUT/records/warmup" \
  --model llama-3.1-8b --jobs 8,1 --child-timeout 200
case "$GPU" in
  *H200*) TAIL=40 run fp8kv-b512 150 python3 -u benchmarks/kernels/bench_paged_fp8_sweep.py \
    --out "$OUT/records/b512" --shapes 512x1536 --deadline-s 100 ;;
esac
