#!/usr/bin/env bash
# Session 31, fourth device call (~150 s, H100 or H200): the FP8 GEMM at 64 (and 32) tokens
# on the large weights, bench_matmul --plan m64 (matmul_plans.plan_m64): the engine's Triton
# tile, the H100 sweep's best Triton tile (call 3), the Mosaic swap-AB kernel, and the
# Mosaic kernel in the plain orientation with one 64-token row tile; XLA bf16 beside; every
# kernel checked against the float32 reference first, all compiled before any is timed.
#   OUT=... bash scripts/gpu_call_s31_d.sh
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/logs/nvidia-smi.txt"
TAIL=12 run mm-m64 200 python3 -u benchmarks/kernels/bench_matmul.py --plan m64 --ms 64,32 \
  --shapes 70b_up,8b_gate_up,70b_o,8b_down --ceilings bw --compile-first --budget 170 \
  --compile-timeout 90 --out "$OUT/records/mm-m64"
