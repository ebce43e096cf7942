#!/usr/bin/env bash
# Session 13, call 4 (H200, ~3 min): the Triton W8A8 decode GEMM's FP8 dot on wgmma
# (TritonConfig.fast_accum: maxNumImpreciseAcc = 128 on the tt.dot, fp8_fast_accum.py)
# against the engine's tiles (f16 mma.sync after widening), kernel alone, every shape at
# 1 / 16 / 32 / 64 tokens; each kernel checked against the float32 reference first.
#   OUT=... bash scripts/gpu_call_s13_fastacc.sh   (limit 240 s)
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
TAIL=34 run mm-fastacc 200 python3 -u benchmarks/kernels/bench_matmul.py --plan fastacc \
  --ms 1,16,32,64 --compile-first --ceilings bw --budget 170 --out "$OUT/records/mm"
