#!/usr/bin/env bash
# Session 31, first device call (~360 s, an H200): the peers' 1000 / 1000 offline shape (512
# requests, 8B FP8 weights, random at real shapes) with the KV pool the FP8 cache makes room
# for. Same KV memory (~70 GiB) in both runs, multi-step decode (k = 8), up to 512 running
# sequences (decode bucket 512 added):
#   (a) bf16 KV, 36,000 pages (576k tokens: ~288 sequences of 2,000 tokens fit);
#   (b) FP8 KV, 72,000 pages (1.15M tokens: all 512 fit).
# Session 9 (H200, bf16 KV, 256 sequences, one step a program): 8,813 output tok/s;
# TensorRT-LLM v0.17's published H200 FP8 figure: 17,538.
#   OUT=... bash scripts/gpu_call_s31_a.sh
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/logs/nvidia-smi.txt"
BASE="--load-format dummy --model llama-3.1-8b --quantization fp8 $OPTS --max-num-seqs 512
  --decode-buckets 1,16,32,64,128,256,512 --num-scheduler-steps 8"
for v in a b; do
  EXTRA="--num-kv-pages 36000"; [ $v = b ] && EXTRA="--kv-cache-dtype fp8 --num-kv-pages 72000"
  # shellcheck disable=SC2086  # option lists
  TAIL=4 run "compile-$v" 170 $JI compile $BASE $EXTRA --cache-dir /tmp/c-$v --modes sample \
    --jobs 14
  # shellcheck disable=SC2086
  TAIL=30 run "O-$v" 140 $JI bench offline $BASE $EXTRA --cache-dir /tmp/c-$v \
    --out "$OUT/records/O-$v" --time-limit 75 --input-len 1000 --output-len 1000 \
    --num-prompts 512
done
summarize_offline "$OUT"/records/O-*/*.json
