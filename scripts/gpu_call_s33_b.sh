#!/usr/bin/env bash
# Session 33 (~300 s, H100 or H200): after mgpu_gemm.FILL_TILE_N = 64 became the default
# (the "waves" rule). 1. The 512-row FP8 + FP8-KV decode step profiled with the new default
# (expect s33_a's "waves" figures: GEMMs o ~476, down ~1537 us a step) and with the fill off.
# 2. The shapes the rule takes, or ties, beyond s33_a's sweep: 8B and 70B qkv at 512 and
# 1,024 rows (the rule takes 70B qkv at both, 8B qkv at 1,024) and 70B o at 512 (a tie: not
# taken), the m512 kernel sweep (each kernel checked against the float32 reference first).
#   OUT=... bash scripts/gpu_call_s33_b.sh
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/logs/nvidia-smi.txt"
P="python3 -u benchmarks/profile_decode.py --backend pallas:fp8:fp8 --batch 512 --ctx 1536
  --steps 10 --synthetic --num-kv-pages 51200"
# shellcheck disable=SC2086  # option list
TAIL=4 run prof-default 100 $P --out "$OUT/records/prof512_default"
# shellcheck disable=SC2086
TAIL=4 run prof-off 100 $P --out "$OUT/records/prof512_off" \
  --patch pallas_kernels.matmul.mgpu_gemm.FILL_TILE_N=None
TAIL=20 run mm-qkv 260 python3 -u benchmarks/kernels/bench_matmul.py --plan m512 \
  --ms 512,1024 --shapes 8b_qkv,70b_qkv,70b_o --ceilings all --compile-first --budget 230 \
  --compile-timeout 150 --out "$OUT/records/mm-qkv"
grep -h "device busy\|by position" "$OUT"/logs/prof-*.log
