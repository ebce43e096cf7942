#!/usr/bin/env bash
# Session 9, H200: the engine's middle band (128 / 256 rows: the 128 / 256 decode buckets
# and the 128-token prefill bucket), where FP8 weights run as XLA W8A16 today. Kernel
# candidates of benchmarks/kernels/matmul_plans.plan_mid against XLA bf16 / W8A16 / W8A8,
# ceilings (copy, read, bf16 and FP8 matmul rates) in the same process.
#   OUT=... bash scripts/gpu_call_s9_mid.sh
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader | tee "$OUT/logs/nvidia-smi.txt"
TAIL=60 run mid 560 python3 benchmarks/kernels/bench_matmul.py --plan mid --ms 256,128 \
  --shapes 8b_qkv,8b_o,8b_gate_up,8b_down,70b_up --budget 470 --guard-timeout 100 \
  --out "$OUT/records/mid"
