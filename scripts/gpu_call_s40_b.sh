#!/usr/bin/env bash
# Session 40 call b (either card): call a's research-test failures in detail, and the
# variant stall with the prefill programs warmed too (as `serve` on a GPU).
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/logs/nvidia-smi.txt"
TAIL=60 run research-tests 150 env JAX_PLATFORMS=cuda PYTHONPATH="$PYTHONPATH:scripts" python3 -m pytest -q -x \
  -p no:cacheprovider -p pytest_small_pools -p pytest_float32 tests/models/test_research.py
TAIL=8 run variant-stall 300 python3 benchmarks/variant_stall.py --out "$OUT/records/stall" \
  --quantization fp8 --k 8 --streams 8 --decode-buckets 8,16
