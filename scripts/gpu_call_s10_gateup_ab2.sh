#!/usr/bin/env bash
# Session 10, call 5 (H200): call 4's A/B again, interleaved twice (old, new, old, new), with
# the engine's fused gate_up limited to <= 16 rows (FP8_GATE_UP_EPILOGUE_MAX_M).
#   OLD=<snapshot of 598a6f6> OUT=... bash scripts/gpu_call_s10_gateup_ab2.sh
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
ENG="--model llama-3.1-8b $OPTS --quantization fp8 --max-num-seqs 64 --decode-buckets 1,16,64
  --prefill-buckets 128,1024 --max-num-batched-tokens 1024 --max-prefill-seqs 16"
NEW=$PWD
for rep in 1 2; do
  for tree in old new; do
    if [ $tree = old ]; then cd "${OLD:?}"; else cd "$NEW"; fi
    # shellcheck disable=SC2086
    [ $rep = 1 ] && TAIL=1 run compile-$tree 120 $JI compile $ENG --cache-dir /tmp/h-$tree --modes sample --jobs 14
    # shellcheck disable=SC2086
    TAIL=4 run latency-$tree-$rep 120 $JI bench latency $ENG --cache-dir /tmp/h-$tree \
      --out "$OUT/records/$tree" --prompt-lens 128 --concurrency 1,16,64 --input-len 128 --output-len 128
  done
done
