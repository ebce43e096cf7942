#!/usr/bin/env bash
# Next session (H200, limit ~580 s; prepared in session 22, not run): session 22's KV-write
# default ("auto": rows below 64 tokens, unique_indices from 64) end to end on the 8B shape,
# beside the torch.compile peer, against the old scatter (--patch
# reference.KV_WRITE_METHOD="scatter") in a second process: FP8 weights + FP8 KV and bf16, at
# batch 1 and 64. Session 22's profile A/B (FP8/FP8, 64 rows, ctx 512) predicts -0.44 ms a
# step (writes 650 -> 211 us); batch 1 ~ -0.03 ms (3.7 -> 2.7 us a layer).
#   OUT=... bash scripts/gpu_call_next_s23.sh   (.peers/ carried)
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
GD="python3 -u benchmarks/gpu_decode.py --backends pallas:fp8:fp8 pallas --batches 1 64
  --steps 32 --budget-s 250"
# shellcheck disable=SC2086
TAIL=12 run e2e8-new 270 $GD --peer .peers/torch_compile_llama.py --out "$OUT/records/e2e8_new"
# shellcheck disable=SC2086
TAIL=12 run e2e8-old 270 $GD --peer "" \
  --patch 'pallas_kernels.paged_attention.reference.KV_WRITE_METHOD="scatter"' \
  --out "$OUT/records/e2e8_old"
grep -H -o '"tpot_ms_[a-z]*": [0-9.]*' "$OUT"/logs/e2e8*.log
