#!/usr/bin/env bash
# Session 10, call 1 (H200): where an 8B decode step's device time goes in FP8 against bf16.
# FP8 batch-1 TPOT (4.77 ms, session 9) is barely below bf16's (4.73 ms) although the FP8
# GEMMs alone should save ~1.4 ms a step (NOTES_matmul: 81 vs 124 us of GEMM a layer at
# M = 1). profile_decode.py --synthetic replays the compiled decode bucket on fixed inputs and
# sums the trace's kernel time per name and class (the profiler turns command buffers off).
#   OUT=... bash scripts/gpu_call_s10_prof.sh
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
P="python3 -u benchmarks/profile_decode.py --synthetic --ctx 512 --steps 10 --top 60"
TAIL=70 run prof-bf16-b1 150 $P --backend pallas --batch 1 --out "$OUT/records/bf16_b1"
TAIL=70 run prof-fp8-b1 150 $P --backend pallas:fp8 --batch 1 --out "$OUT/records/fp8_b1"
TAIL=70 run prof-fp8-b64 150 $P --backend pallas:fp8 --batch 64 --out "$OUT/records/fp8_b64"
pack
