#!/usr/bin/env bash
# Next session (H200, ~9 min): the current defaults (session 14: deep K off, fast accum on)
# against the torch.compile peer in one call, and the 70B at batch 1 / 32.
# (1) 8B, peer + ours bf16 and FP8 at batch 1 / 16 / 64 (ours over the peer's time).
# (2) 70B FP8 at batch 1 / 32 (session 14's 18.97 ms a step at batch 1 was measured with
#     batch 1 only).
#   OUT=... bash scripts/gpu_call_next_s15.sh   (limit 600 s; .peers/ carried)
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
TAIL=10 run e2e8-peer 280 python3 -u benchmarks/gpu_decode.py --quick \
  --peer .peers/torch_compile_llama.py --backends pallas:fp8 pallas --batches 1 16 64 \
  --steps 32 --budget-s 260 --out "$OUT/records/e2e8_peer"
XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 TAIL=4 run e2e70 230 python3 -u benchmarks/gpu_decode.py \
  --quick --peer none --backends pallas:fp8 --model dummy:llama-3.1-70b --batches 1 32 \
  --steps 32 --budget-s 210 --out "$OUT/records/e2e70"
grep -H -o '"tpot_ms_[a-z]*": [0-9.]*' "$OUT"/logs/e2e*.log
