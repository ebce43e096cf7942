#!/usr/bin/env bash
# Session 24 call 2 (H200; prepared in session 23, the 8-warp Gemma run dropped): row_quant's warps where
# session 23 did not time them. (1) Gemma 3 270M's narrow rows (640 / 2048 columns: 4 warps by
# ROW_QUANT_WIDE_K) at 32 rows, FP8 weights + FP8 KV: default vs 16 warps (WIDE_K=0); (2) the 70B shape at batch 1 (8192-column rows, 16 warps by default; its down input,
# 28672 columns, is beyond row_quant and stays on XLA): default vs session 22's 4 warps /
# passes. Adopt a narrower WIDE_K (or a per-width warp count) if the device busy drops.
#   OUT=... bash scripts/gpu_call_next_s24.sh
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
RQ=pallas_kernels.matmul.row_quant
G="python3 -u benchmarks/profile_decode.py --model dummy:gemma-3-270m --backend pallas:fp8:fp8
  --batch 32 --ctx 2048 --steps 10 --synthetic --top 14"
# shellcheck disable=SC2086
TAIL=16 run g270-default 80 $G --out "$OUT/records/g270_default"
# shellcheck disable=SC2086
TAIL=16 run g270-w16 80 $G --patch $RQ.ROW_QUANT_WIDE_K=0 --out "$OUT/records/g270_w16"
S="python3 -u benchmarks/profile_decode.py --model dummy:llama-3.1-70b --backend pallas:fp8:fp8
  --batch 1 --ctx 512 --steps 10 --synthetic --top 14"
# shellcheck disable=SC2086
TAIL=16 run p70-default 160 $S --out "$OUT/records/p70_default"
# shellcheck disable=SC2086
TAIL=16 run p70-old 160 $S --patch $RQ.ROW_QUANT_WARPS=4 --patch $RQ.ROW_QUANT_ONE_PASS=False \
  --out "$OUT/records/p70_old"
