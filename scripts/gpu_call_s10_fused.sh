#!/usr/bin/env bash
# Session 10, call 2 (H200): the Triton W8A8 decode GEMM with x quantized inside it (per
# token and 128 columns) and the split-K partials merged inside it (fuse "all", the new
# default) against "merge" only and the session-4 kernel ("none") — bench_matmul --plan fused
# at 1 / 16 / 64 rows on the 8B projections and 70b_up, every job checked against the float32
# reference first — then the 8B FP8 decode step profiled again at batch 1 and 64 (call 1 of
# this session profiled the old kernel: 783 kernels, 3.50 ms busy at batch 1).
#   OUT=... bash scripts/gpu_call_s10_fused.sh
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
TAIL=40 run mm-fused 230 python3 -u benchmarks/kernels/bench_matmul.py --plan fused --ms 1,16,64 \
  --shapes 8b_qkv,8b_o,8b_gate_up,8b_down,70b_up --ceilings bw --budget 170 --out "$OUT/records/mm"
P="python3 -u benchmarks/profile_decode.py --synthetic --ctx 512 --steps 10 --top 40"
TAIL=45 run prof-fp8-b1 150 $P --backend pallas:fp8 --batch 1 --out "$OUT/records/fp8_b1"
TAIL=30 run prof-fp8-b64 150 $P --backend pallas:fp8 --batch 64 --out "$OUT/records/fp8_b64"
pack
