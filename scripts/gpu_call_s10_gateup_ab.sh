#!/usr/bin/env bash
# Session 10, call 4 (H200): same-call A/B of the engine's FP8 gate_up form — SwiGLU from the
# Triton decode GEMM's float32 epilogue (this tree, gate_up=True) against the [T, 2F] bf16
# GEMM output and a separate SiLU-multiply fusion (the tree at 598a6f6, in $OLD) — with the
# options of gpu_call_s10_fuse_e2e.sh (8B FP8, decode buckets 1 / 16 / 64).
#   OLD=<snapshot of 598a6f6> OUT=... bash scripts/gpu_call_s10_gateup_ab.sh
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
ENG="--model llama-3.1-8b $OPTS --quantization fp8 --max-num-seqs 64 --decode-buckets 1,16,64
  --prefill-buckets 128,1024 --max-num-batched-tokens 1024 --max-prefill-seqs 16"
NEW=$PWD
for tree in old new; do
  if [ $tree = old ]; then cd "${OLD:?}"; else cd "$NEW"; fi
  # shellcheck disable=SC2086
  TAIL=2 run compile-$tree 120 $JI compile $ENG --cache-dir /tmp/g-$tree --modes sample --jobs 14
  # shellcheck disable=SC2086
  TAIL=6 run latency-$tree 120 $JI bench latency $ENG --cache-dir /tmp/g-$tree \
    --out "$OUT/records/$tree" --prompt-lens 128 --concurrency 1,16,64 --input-len 128 --output-len 128
done
cd "$NEW"
TAIL=45 run prof-fp8-b1-new 150 python3 -u benchmarks/profile_decode.py --synthetic --ctx 512 \
  --steps 10 --top 30 --backend pallas:fp8 --batch 1 --out "$OUT/records/fp8_b1_new"
