#!/usr/bin/env bash
# Session 31, third device call (~230 s, H100 or H200): the FP8 decode GEMM at 64 tokens,
# where the large weights stream at 2.3-2.8 TB/s (issue #4 asks 3.6): the engine's Triton
# W8A8 tile against session 13's wide tiles and 256-row weight tiles (matmul_plans.TILES_BN256),
# each with and without the FP8 dot on wgmma; every kernel checked against the float32
# reference first, all compiled before any is timed; XLA bf16 beside.
#   OUT=... bash scripts/gpu_call_s31_c.sh
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/logs/nvidia-smi.txt"
TAIL=16 run mm-wide 240 python3 -u benchmarks/kernels/bench_matmul.py --plan wide --ms 64 \
  --shapes 70b_up,8b_gate_up,70b_o --ceilings bw --compile-first --budget 200 \
  --out "$OUT/records/mm-wide"
