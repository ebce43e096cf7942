#!/usr/bin/env bash
# Session 32, second device call (~480 s, an H200): the peers' 1000 / 1000 x 512 offline
# shape with 8B FP8 weights and the FP8 KV cache (session 31 call 1: 14,365 output tok/s at
# 16-token pages), at 64-token KV pages (--block-size 64, the same 70.3 GiB: 18,000 pages)
# against 16 (72,000 pages), in one call. Run it if call 1's kernel sweep (s32_a) finds the
# FP8 decode kernels faster at 64-token pages.
#   OUT=... bash scripts/gpu_call_s32_b.sh
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/logs/nvidia-smi.txt"
BASE="--load-format dummy --model llama-3.1-8b --quantization fp8 $OPTS --max-num-seqs 512
  --decode-buckets 1,16,32,64,128,256,512 --num-scheduler-steps 8 --kv-cache-dtype fp8"
for ps in 64 16; do
  EXTRA="--block-size $ps --num-kv-pages $((72000 * 16 / ps))"
  # shellcheck disable=SC2086  # option lists
  TAIL=4 run "compile-ps$ps" 150 $JI compile $BASE $EXTRA --cache-dir /tmp/c-$ps \
    --modes sample --jobs 14
  # shellcheck disable=SC2086
  TAIL=30 run "O-ps$ps" 140 $JI bench offline $BASE $EXTRA --cache-dir /tmp/c-$ps \
    --out "$OUT/records/O-ps$ps" --time-limit 75 --input-len 1000 --output-len 1000 \
    --num-prompts 512
done
summarize_offline "$OUT"/records/O-*/*.json
