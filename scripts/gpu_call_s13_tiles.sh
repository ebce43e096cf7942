#!/usr/bin/env bash
# Session 13, call 1 (H200, ~4.5 min): a tile sweep around the engine's Triton W8A8 decode
# GEMM (bench_matmul --plan tiles: the kernel alone, as the engine's norm_quant path calls
# it), every shape at 1 / 16 / 64 / 32 tokens, XLA bf16 beside it; each kernel checked
# against the float32 reference first.
#   OUT=... bash scripts/gpu_call_s13_tiles.sh   (limit 330 s)
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
TAIL=40 run mm-tiles 290 python3 -u benchmarks/kernels/bench_matmul.py --plan tiles \
  --ms 1,16,64,32 --ceilings bw --budget 250 --out "$OUT/records/mm"
