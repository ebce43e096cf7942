#!/usr/bin/env bash
# Session 12, call 4 (H200, ~3 min): the Triton W8A8 decode GEMM with 512-deep K steps in 3
# stages (fp8_plan.FP8_DECODE_DEEP_K, the new default for large weights at <= 16 tokens)
# against the 256-deep / 4-stage tiles it replaces (tri_w8a8_kernel_k256), the kernel alone
# and per call with XLA's quantization, beside XLA bf16; 8b_qkv first (unchanged: a control,
# and the run's first jobs have shown warm-up outliers).
#   OUT=... bash scripts/gpu_call_s12_deepk.sh   (limit 240 s)
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
TAIL=30 run mm-deepk 170 python3 -u benchmarks/kernels/bench_matmul.py --plan engine \
  --ms 1,16 --shapes 8b_qkv,8b_down,70b_up,70b_o --ceilings bw --budget 110 \
  --out "$OUT/records/mm"
