#!/usr/bin/env bash
# Session 30, second device call (~330 s, H100 or H200): the peers' 1000 / 1000 offline shape
# (512 requests, 8B FP8 weights, random at real shapes) with today's engine, last measured in
# session 9 (8,813 output tok/s, TPOT p50 27.5 ms, record *1000x1000-20261202T010114*):
#   (a) the same options as then (async scheduling and the RoPE + KV write kernel are
#       defaults since), bf16 KV;
#   (b) + FP8 KV cache and multi-step decode (k = 8).
# Each engine configuration is compiled once by `jaxinfer compile` into its own cache.
# PAGES: KV pool pages (default 36,000 as in session 9: 70 GiB of bf16 KV, too much for an
# H100's 80 GB beside the weights; PAGES=20000 there).
#   OUT=... [PAGES=20000] bash scripts/gpu_call_s30_b.sh
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/logs/nvidia-smi.txt"
BASE="--load-format dummy --model llama-3.1-8b --quantization fp8 $OPTS --num-kv-pages ${PAGES:-36000}"
for v in a b; do
  EXTRA=""; [ $v = b ] && EXTRA="--kv-cache-dtype fp8 --num-scheduler-steps 8"
  # shellcheck disable=SC2086  # option lists
  TAIL=4 run "compile-$v" 150 $JI compile $BASE $EXTRA --cache-dir /tmp/c-$v --modes sample \
    --jobs 14
  # shellcheck disable=SC2086
  TAIL=30 run "O-$v" 140 $JI bench offline $BASE $EXTRA --cache-dir /tmp/c-$v \
    --out "$OUT/records/O-$v" --time-limit 75 --input-len 1000 --output-len 1000 \
    --num-prompts 512
done
summarize_offline "$OUT"/records/O-*/*.json
