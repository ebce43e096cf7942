#!/usr/bin/env bash
# Session 34 (~420 s, an H200: 70B FP8 weights + a 50 GiB KV pool need > 80 GB). The 70B
# 1000 / 1000 offline run at the concurrency the FP8 KV cache makes room for. Sessions 31-33
# ran it with 64 sequences and 8,448 pages (1,774 output tok/s, TPOT p50 31.1 ms, session 33
# call 4): 64 rows leave the decode GEMMs weight-bound (70 GB a step for 64 tokens). With FP8
# KV a 16-token page of the 70B is 2.6 MB, so 20,480 pages (50 GiB beside 68 GiB of weights)
# hold 160 sequences of 2,000 tokens; the same weight read then serves 2.5x the rows.
# Llama-3.1-70B FP8 + FP8 KV, k = 8; 160 x 1000 / 1000, then 128 x 1000 / 1000 on the same
# compiled programs (the bucket set holds both).
#   OUT=... bash scripts/gpu_call_s34_b.sh
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/logs/nvidia-smi.txt"
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.92  # 68 GiB of 70B FP8 weights + 50 GiB of KV pages
E70="--load-format dummy --model llama-3.1-70b --quantization fp8 --max-model-len 2048
  --max-num-seqs 160 --max-num-batched-tokens 8192 --max-prefill-seqs 8
  --prefill-buckets 1024,8192 --decode-buckets 8,32,64,128,160 --num-kv-pages 20480
  --kv-cache-dtype fp8 --num-scheduler-steps 8"
# shellcheck disable=SC2086  # option lists
TAIL=3 run compile-70b 150 $JI compile $E70 --cache-dir /tmp/c70 --modes sample --jobs 14
for n in ${NS:-160 128}; do
  # shellcheck disable=SC2086
  TAIL=22 run "O-70b-n$n" 190 $JI bench offline --out "$OUT/records/n$n" --time-limit 120 \
    $E70 --cache-dir /tmp/c70 --input-len 1000 --output-len 1000 --num-prompts "$n"
done
summarize_offline "$OUT"/records/n*/*.json
