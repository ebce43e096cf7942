#!/usr/bin/env bash
# Session 43 call b (~70 s + start, an H100 or H200): structured outputs' masks overlapping the
# model program (the engine now) vs loaded before it (call a's order), end to end: the engine
# part of gpu_call_s43_a.sh, whose regex rows now run both ways in one process.
#   OUT=... bash scripts/gpu_call_s43_b.sh
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/logs/nvidia-smi.txt"
ARGS='{"quantization": "fp8", "num_scheduler_steps": 8, "decode_buckets": [8],
  "prefill_buckets": [128], "max_num_batched_tokens": 128, "max_prefill_seqs": 8}'
for rows in 8 64; do
  TAIL=5 run "so-engine-8b-r$rows" 200 python3 -u benchmarks/structured_outputs_cost.py \
    --out "$OUT/records/r$rows" --parts engine --model dummy:llama-3.1-8b \
    --tokenizer-dir smollm2-135m-tokenizer --rows "$rows" --max-tokens 64 \
    --engine-args "${ARGS/\[8\]/[$rows]}"
done
