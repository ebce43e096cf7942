#!/usr/bin/env bash
# Session 33 (~330 s, H100 or H200): the rule for mgpu_gemm.FILL_TILE_N = 64 (128 x 128 CTA
# tiles where 128 x 256 leave SMs idle). Session 33's first call: the rule "sms" (fewer CTA
# tiles than SMs) took the 512-row step's Mosaic GEMMs from 6.98 to 6.26 ms, but the kernel
# sweep timed qkv's 128 x 128 tiles 15 % slower (37.6 vs 32.7 us). 1. The device-only profile
# of the 512-row FP8 + FP8-KV decode step, each GEMM timed by its place in the layer
# (profile_decode's by_position: qkv, o, gate_up, down), with FILL_RULE "sms", "waves" and
# without the fill. 2. The m512 kernel sweep for the o, gate_up and down shapes (each kernel
# checked against the float32 reference first).
#   OUT=... bash scripts/gpu_call_s33_a.sh
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/logs/nvidia-smi.txt"
P="python3 -u benchmarks/profile_decode.py --backend pallas:fp8:fp8 --batch 512 --ctx 1536
  --steps 10 --synthetic --num-kv-pages 51200"
F=pallas_kernels.matmul.mgpu_gemm
# shellcheck disable=SC2086  # option list
TAIL=4 run prof-base 100 $P --out "$OUT/records/prof512_base"
# shellcheck disable=SC2086
TAIL=4 run prof-sms 100 $P --out "$OUT/records/prof512_sms" --patch $F.FILL_TILE_N=64
# shellcheck disable=SC2086
TAIL=4 run prof-waves 100 $P --out "$OUT/records/prof512_waves" --patch $F.FILL_TILE_N=64 \
  --patch "$F.FILL_RULE='waves'"
TAIL=14 run mm-m512 200 python3 -u benchmarks/kernels/bench_matmul.py --plan m512 --ms 512 \
  --shapes 8b_o,8b_gate_up,8b_down --ceilings all --compile-first --budget 170 \
  --compile-timeout 120 --out "$OUT/records/mm-m512"
grep -h "device busy\|by position" "$OUT"/logs/prof-*.log
