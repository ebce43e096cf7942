#!/usr/bin/env bash
# Session 9, H200: the paged decode's in-kernel split merge (merge="auto": in the kernel at
# B * Hkv <= 16) end to end at batch 1 against the XLA merge ($JAXINFER_DECODE_MERGE=xla):
# 8B bf16, 1 stream of 128 or 2048 prompt tokens + 128 output tokens; the torch.compile peer
# in the same call.
#   OUT=... bash scripts/gpu_call_s9_merge.sh
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
ENG="--model llama-3.1-8b $OPTS"
for m in auto xla; do
  export JAXINFER_DECODE_MERGE=$m
  # shellcheck disable=SC2086
  TAIL=3 run compile-$m 120 $JI compile $ENG --cache-dir /tmp/m-$m --modes sample --jobs 14
  # shellcheck disable=SC2086
  for isl in 128 2048; do
    # shellcheck disable=SC2086
    TAIL=4 run latency-$m-$isl 70 $JI bench latency $ENG --cache-dir /tmp/m-$m \
      --out "$OUT/records" --prompt-lens 128 --concurrency 1 --input-len $isl --output-len 128
  done
done
unset JAXINFER_DECODE_MERGE
TAIL=5 run peer 120 python3 .peers/torch_compile_llama.py --batch 1 --ctx 512 --steps 128 \
  --json "$OUT/records/peer_torch_compile.json"
