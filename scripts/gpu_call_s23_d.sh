#!/usr/bin/env bash
# Session 23, call 4 (H200, limit ~580 s; .peers/ carried): (1) bench_row_quant with CUPTI
# kernel time (the old 4 warps / passes vs the new 16 warps / one pass, and SwiGLU fused vs
# unfused) at 1 and 64 rows; (2) the engine end to end on the 8B shape with sessions 22-23's
# defaults (KV write "auto", row_quant 16 warps / one pass, FUSE_SWIGLU_QUANT) beside the
# torch.compile peer: FP8 weights + FP8 KV at batch 1 and 64, bf16 at batch 1; (3) the same
# FP8 engine with the old settings patched back, in another process.
#   OUT=... bash scripts/gpu_call_s23_d.sh
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
TAIL=14 run rq 75 python3 -u benchmarks/kernels/bench_row_quant.py --ms 1,64 \
  --variants w4,w16s --deadline-s 55 --out "$OUT/records/rq"
GD="python3 -u benchmarks/gpu_decode.py --batches 1 64 --steps 32"
# shellcheck disable=SC2086
TAIL=12 run e2e8-new 280 $GD --backends pallas:fp8:fp8 pallas --budget-s 250 \
  --peer .peers/torch_compile_llama.py --out "$OUT/records/e2e8_new"
# shellcheck disable=SC2086
TAIL=8 run e2e8-old 170 $GD --backends pallas:fp8:fp8 --budget-s 150 --quick --peer "" \
  --patch 'pallas_kernels.paged_attention.reference.KV_WRITE_METHOD="scatter"' \
  --patch pallas_kernels.matmul.row_quant.ROW_QUANT_WARPS=4 \
  --patch pallas_kernels.matmul.row_quant.ROW_QUANT_ONE_PASS=False \
  --patch jaxinfer.models.transformer.FUSE_SWIGLU_QUANT=False --out "$OUT/records/e2e8_old"
grep -H -o '"tpot_ms_[a-z]*": [0-9.]*' "$OUT"/logs/e2e8*.log
