#!/usr/bin/env bash
# Session 21, call 6 (H200, limit 330 s): end to end on a random Gemma 3 with 270M's heads
# (4/1/256, sliding-window layers): Pallas against the reference backend through LLM.generate,
# FP8 and bf16 KV, at a 32-row decode bucket (the 32-token-step defaults) and a 4-row one
# (FP8 kq8, bf16 8 warps).
#   OUT=... bash scripts/gpu_call_s21_e.sh
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
CHK="python3 -u benchmarks/kernels/check_fp8_kv_engine.py --small gemma3-d256 --skip-timing"
TAIL=8 run e2e-g4-r32 170 $CHK --rows 32 --prompts 32 --out "$OUT/records/e2e_g4_r32"
TAIL=8 run e2e-g4-r4 130 $CHK --rows 4 --prompts 4 --out "$OUT/records/e2e_g4_r4"
