#!/usr/bin/env bash
# Prepared in session 33 (~170 s; meant for an H200, runs on either card -- say which): the
# FP8-KV decode kernels at the 1000 / 1000 x 512 run's steady state, 512 rows x 1,536 tokens
# (session 33 call 8, an H100: the engine's pick 0.517 of bf16's time; the H200's step profile
# puts the same kernel at ~3.39 TB/s, ~79 % of its copy rate), every config of the sweep that
# is not made for given shapes, each checked against the reference first; then the default
# grid's B128 ctx2048 point beside it for the record.
#   OUT=... bash scripts/gpu_call_s34_a.sh
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/logs/nvidia-smi.txt"
TAIL=40 run fp8kv-b512 150 python3 -u benchmarks/kernels/bench_paged_fp8_sweep.py \
  --out "$OUT/records/b512" --shapes 512x1536,128x2048 --deadline-s 120
