#!/usr/bin/env bash
# Session 13, call 2 (H200, ~8 min): session 13's decode GEMM tiles ("wave15", from call 1's
# sweep) against session 12's ("wave2"): (1) the kernel alone as the engine calls it, every
# shape at 1 / 16 / 32 / 64 tokens, compiled before any timing; (2) the 8B FP8 engine's
# decode TPOT at batch 1 / 16 / 32 / 64 under each (JAXINFER_FP8_DECODE_TILES, one process
# each), the torch.compile peer (batch 1, ctx 512) in the first.
#   OUT=... bash scripts/gpu_call_s13_tiles_e2e.sh   (limit 600 s)
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
TAIL=30 run mm-engine 150 python3 -u benchmarks/kernels/bench_matmul.py --plan engine \
  --ms 1,16,32,64 --skip 'mdec|none' --compile-first --ceilings bw --budget 120 \
  --out "$OUT/records/mm"
JAXINFER_FP8_DECODE_TILES=wave15 TAIL=8 run e2e8-wave15 215 python3 -u benchmarks/gpu_decode.py \
  --quick --peer .peers/torch_compile_llama.py --backends pallas:fp8 --batches 1 16 32 64 \
  --steps 32 --budget-s 195 --out "$OUT/records/e2e8_wave15"
JAXINFER_FP8_DECODE_TILES=wave2 TAIL=6 run e2e8-wave2 170 python3 -u benchmarks/gpu_decode.py \
  --quick --peer none --backends pallas:fp8 --batches 1 16 32 64 \
  --steps 32 --budget-s 150 --out "$OUT/records/e2e8_wave2"
grep -H -o '"tpot_ms_[a-z]*": [0-9.]*' "$OUT"/logs/e2e*.log
