#!/usr/bin/env bash
# Session 43 call a (~300 s + start, an H100 or H200): what structured outputs cost on the GPU
# (benchmarks/structured_outputs_cost.py). The mask-loading program alone at 49k / 262k
# vocabularies and 1-64 rows; llguidance's masks of 8 / 64 rows on the host's 16 CPUs (one by
# one vs its threads); then Llama-3.1-8B FP8 (random weights) with SmolLM2's tokenizer
# attached (saved under smollm2-135m-tokenizer/ by `Tokenizer.save`), 8 greedy rows of 64
# tokens, multi-step decode k = 8: every row held to a regex (one step a program) vs none
# (8-step windows).
# Needs llguidance's wheel under .whl/ (installed by gpu_call_lib.sh).
#   OUT=... bash scripts/gpu_call_s43_a.sh
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/logs/nvidia-smi.txt"
SO="python3 -u benchmarks/structured_outputs_cost.py --out $OUT/records"
TAIL=8 run so-program 90 $SO --parts program
TAIL=6 run so-mask 120 $SO --parts mask --mask-tokenizers smollm2-135m-tokenizer
ARGS='{"quantization": "fp8", "num_scheduler_steps": 8, "decode_buckets": [8],
  "prefill_buckets": [128], "max_num_batched_tokens": 128, "max_prefill_seqs": 8}'
TAIL=4 run so-engine-8b 300 $SO --parts engine --model dummy:llama-3.1-8b \
  --tokenizer-dir smollm2-135m-tokenizer --rows 8 --max-tokens 64 --engine-args "$ARGS"
