#!/usr/bin/env bash
# Session 12, call 3 (H200, ~8 min): check_row_quant.py's engine half (call 2 cut it at its
# guard): float32 engines with / without the fused norm + quantization kernel must give the
# same greedy tokens; then the torch.compile peer (batch 1, ctx 512) and the engine's decode
# TPOT, FP8 and bf16, batches 1 and 16, in one process after the peer (gpu_decode.py).
#   OUT=... bash scripts/gpu_call_s12_peer.sh   (limit 600 s)
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
TAIL=3 run check-engine 170 python3 -u benchmarks/kernels/check_row_quant.py --engine-only \
  --out "$OUT/records/check"
TAIL=12 run e2e-peer 330 python3 -u benchmarks/gpu_decode.py --quick \
  --peer .peers/torch_compile_llama.py --backends pallas:fp8 pallas --batches 1 16 \
  --steps 32 --budget-s 300 --out "$OUT/records/e2e"
