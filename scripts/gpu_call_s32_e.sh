#!/usr/bin/env bash
# Session 32 (~140 s, H100 or H200): the FP8 GEMMs of a 512-row decode step
# (bench_matmul --plan m512, matmul_plans.plan_m512): the engine's Mosaic tile (128 x 256 CTA
# tiles: 64-96 CTAs on 132 SMs for the 4096- and 6144-wide weights at 512 rows) against
# 128 x 128 and 64 x 256 CTA tiles, XLA's FP8 and bf16 dots beside; each kernel checked
# against the float32 reference first, all compiled before any is timed; the 8192^3 matmul
# rates measured in the same run (TFLOP/s over them).
#   OUT=... bash scripts/gpu_call_s32_e.sh
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/logs/nvidia-smi.txt"
TAIL=14 run mm-m512 140 python3 -u benchmarks/kernels/bench_matmul.py --plan m512 --ms 512 \
  --shapes 8b_qkv,8b_o,8b_gate_up,8b_down --ceilings all --compile-first --budget 110 \
  --compile-timeout 90 --out "$OUT/records/mm-m512"
