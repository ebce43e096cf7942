#!/usr/bin/env bash
# Session 28, call 2 (~120 s): where check_rope_kv_write's failures of call 1 come from
# (benchmarks/kernels/diag_rope_kv_write.py): FP8 rounding ties of XLA and Triton vs the
# host's round-to-nearest-even; q at the failing points from the kernel, the kernel
# interpreted on the GPU, XLA on the GPU and the CPU reference.
#   OUT=... bash scripts/gpu_call_s28_b.sh
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
TAIL=12 run diag 200 python3 -u benchmarks/kernels/diag_rope_kv_write.py --out "$OUT/records/diag"
