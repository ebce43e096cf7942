#!/usr/bin/env bash
# Session 18, call 2 (H200, ~8 min): the adopted default (decode_options.DEFAULT_UNROLL = 2)
# against the loop (tune u0) in one process, at the B = 1 points it targets, the points it
# must not move (B1 ctx 8192 / 32k and B8 keep the loop) and short contexts at B = 32 (one
# split of 2 steps: now straight-line); then the engine end to end (tiny greedy check on the
# Pallas path, ceilings, 8B bf16 and FP8 at batch 1 / 16) beside the torch.compile peer.
#   OUT=... bash scripts/gpu_call_s18_confirm.sh   (limit 560 s; .peers/ carried)
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
TAIL=20 run psb-default 200 python3 -u benchmarks/kernels/bench_paged_small_batch.py \
  --deadline-s 175 --tunes u0 \
  --points 1x1024,1x2048,1x4096,1x8192,1x32768,8x1024,8x4096,32x128,fp8:1x2048,fp8:1x4096 \
  --out "$OUT/records/psb_default"
TAIL=12 run e2e8-peer 300 python3 -u benchmarks/gpu_decode.py \
  --peer .peers/torch_compile_llama.py --backends pallas:fp8 pallas --batches 1 16 \
  --steps 32 --budget-s 280 --out "$OUT/records/e2e8_peer"
grep -H -o '"tpot_ms_[a-z]*": [0-9.]*\|tiny check.*' "$OUT"/logs/e2e*.log
