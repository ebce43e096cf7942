#!/usr/bin/env bash
# Session 31, second device call (~420 s, an H200): the peers' other offline shapes with the
# FP8 KV pool of call 1 (scripts/gpu_call_s31_a.sh, variant b: 72,000 FP8 pages, up to 512
# running sequences, multi-step decode k = 8), 8B FP8 weights random at real shapes:
#   O-128: 1,024 x 128 / 128 (TensorRT-LLM v0.17, H200: 29,526 output tok/s; ours, session 9: 19,263)
#   O-2048: 128 x 2048 / 2048 (TensorRT-LLM 11,969; ours, session 4: 3,235, none finished in 75 s)
# then Llama-3.1-70B FP8 at 1000 / 1000 x 64 with FP8 KV + k = 8 (TensorRT-LLM 2,823; ours,
# session 4: 1,097, bf16 KV, one step a program).
#   OUT=... bash scripts/gpu_call_s31_b.sh
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/logs/nvidia-smi.txt"
E8="--load-format dummy --model llama-3.1-8b --quantization fp8 $OPTS --max-num-seqs 512
  --decode-buckets 1,16,32,64,128,256,512 --num-scheduler-steps 8 --kv-cache-dtype fp8
  --num-kv-pages 72000 --cache-dir /tmp/c8"
OFF="bench offline --out $OUT/records --time-limit 75"
# shellcheck disable=SC2086  # option lists
TAIL=3 run compile-8b 170 $JI compile $E8 --modes sample --jobs 14
# shellcheck disable=SC2086
TAIL=22 run O-128 120 $JI $OFF $E8 --input-len 128 --output-len 128 --num-prompts 1024
# shellcheck disable=SC2086
TAIL=22 run O-2048 140 $JI $OFF $E8 --input-len 2048 --output-len 2048 --num-prompts 128
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.92  # 67 GiB of 70B FP8 weights + the KV pool
E70="--load-format dummy --model llama-3.1-70b --quantization fp8 --max-model-len 2048
  --max-num-seqs 64 --max-num-batched-tokens 8192 --max-prefill-seqs 8
  --prefill-buckets 1024,8192 --decode-buckets 8,32,64 --num-kv-pages 8448
  --kv-cache-dtype fp8 --num-scheduler-steps 8 --cache-dir /tmp/c70"
# shellcheck disable=SC2086
TAIL=3 run compile-70b 130 $JI compile $E70 --modes sample --jobs 14
# shellcheck disable=SC2086
TAIL=22 run O-70b 170 $JI $OFF $E70 --input-len 1000 --output-len 1000 --num-prompts 64
summarize_offline "$OUT"/records/*.json
