#!/usr/bin/env bash
# Session 44 call a (~250 s + start, an H100 or H200): jump-forward decoding on the GPU
# (benchmarks/jump_forward.py). Llama-3.1-8B FP8 (random weights) with SmolLM2's tokenizer
# attached (saved under smollm2-135m-tokenizer/ by `Tokenizer.save`), greedy rows held to a
# JSON schema, 1 and 8 rows, whitespace-flexible and compact grammars, jump_forward off / on
# on one engine (3 timed runs each, alternating).
# Needs llguidance's wheel under .whl/ (installed by gpu_call_lib.sh).
#   OUT=... bash scripts/gpu_call_s44_a.sh
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/logs/nvidia-smi.txt"
ARGS='{"quantization": "fp8", "prefill_buckets": [16, 64, 128], "max_num_batched_tokens": 128,
  "max_prefill_seqs": 8}'
TAIL=12 run jf-8b 400 python3 -u benchmarks/jump_forward.py --out "$OUT/records" \
  --model dummy:llama-3.1-8b --tokenizer-dir smollm2-135m-tokenizer --rows 1 8 \
  --max-tokens 96 --engine-args "$ARGS"
