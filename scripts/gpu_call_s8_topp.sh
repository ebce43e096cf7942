#!/usr/bin/env bash
# Session 8, issue #7 end to end: 8B bf16 (random weights, the bench suites' engine options),
# 128 / 128 tokens x 1024 prompts (256-row decode steps), sampled at temperature 1 (vLLM's
# benchmarks: no filter) and at temperature 0.8 + top-p 0.9 (the full-vocabulary nucleus
# search every step), in one call; the difference per step is what top-p costs the engine.
#   OUT=... bash scripts/gpu_call_s8_topp.sh
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
ENG="--model llama-3.1-8b $OPTS --cache-dir /tmp/c-bf16"
# shellcheck disable=SC2086
TAIL=4 run compile 150 $JI compile $ENG --modes sample --jobs 14
for mix in "--temperature 1.0" "--temperature 0.8 --top-p 0.9"; do
  id=offline-$(echo "$mix" | tr -d ' -')
  # shellcheck disable=SC2086
  TAIL=16 run "$id" 110 $JI bench offline $ENG --out "$OUT/records" --input-len 128 \
    --output-len 128 --num-prompts 1024 --time-limit 60 $mix
done
