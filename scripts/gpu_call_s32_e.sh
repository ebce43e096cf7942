#!/usr/bin/env bash
# Session 32, prepared (~250 s, H100 or H200): 1. the FP8 GEMMs of a 512-row decode step
# (bench_matmul --plan m512, matmul_plans.plan_m512): the engine's Mosaic tile (128 x 256 CTA
# tiles: 64-96 CTAs on 132 SMs for the 4096- and 6144-wide weights at 512 rows) against
# 128 x 128 and 64 x 256 CTA tiles, XLA's FP8 and bf16 dots beside; each kernel checked
# against the float32 reference first, all compiled before any is timed; the 8192^3 matmul
# rates measured in the same run (TFLOP/s over them). 2. The engine A/B of the rule
# mgpu_gemm.FILL_TILE_N = 64 (128 x 128 CTA tiles where 128 x 256 leave SMs idle): the
# device-only profile of the 512-row FP8 + FP8-KV decode step (RESULTS.md "Session 32 calls
# 2-3") with and without it, one machine.
#   OUT=... bash scripts/gpu_call_s32_e.sh
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/logs/nvidia-smi.txt"
TAIL=14 run mm-m512 140 python3 -u benchmarks/kernels/bench_matmul.py --plan m512 --ms 512 \
  --shapes 8b_qkv,8b_o,8b_gate_up,8b_down --ceilings all --compile-first --budget 110 \
  --compile-timeout 90 --out "$OUT/records/mm-m512"
P="python3 -u benchmarks/profile_decode.py --backend pallas:fp8:fp8 --batch 512 --ctx 1536
  --steps 10 --synthetic --num-kv-pages 51200"
# shellcheck disable=SC2086  # option list
TAIL=8 run prof-fill64 100 $P --out "$OUT/records/prof512_fill64" \
  --patch pallas_kernels.matmul.mgpu_gemm.FILL_TILE_N=64
# shellcheck disable=SC2086
TAIL=8 run prof-base 100 $P --out "$OUT/records/prof512_base"
grep -h "device busy" "$OUT"/logs/prof-*.log
