#!/usr/bin/env bash
# Session 12, call 3 (H200, ~6 min): the torch.compile peer (batch 1, ctx 512) and the
# engine's decode TPOT, FP8 and bf16, batches 1 / 16 / 64, in one process after the peer
# (gpu_decode.py: engine, device replay and back-to-back figures; ours / peer).
#   OUT=... bash scripts/gpu_call_s12_peer.sh   (limit 600 s)
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
TAIL=12 run e2e-peer 420 python3 -u benchmarks/gpu_decode.py --quick \
  --peer .peers/torch_compile_llama.py --backends pallas:fp8 pallas --batches 1 16 64 \
  --steps 32 --budget-s 380 --out "$OUT/records/e2e"
