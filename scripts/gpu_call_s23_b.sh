#!/usr/bin/env bash
# Session 23, call 2 (H200, limit ~580 s): (1) bench_row_quant: norm_quant_fp8 at the 8B
# sites by num_warps, and SwiGLU + the down input's quantization fused (swiglu=True) vs XLA's
# SwiGLU fusion then the kernel; (2) the 8B decode step (FP8 weights and KV, 64 rows, ctx 512)
# per kernel: default / transformer.FUSE_SWIGLU_QUANT / that + the warps the bench picks
# (lowest summed µs of the kernel sites at 64 rows, if > 3 % under 4 warps; else 8).
#   OUT=... bash scripts/gpu_call_s23_b.sh
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
TAIL=30 run rq 140 python3 -u benchmarks/kernels/bench_row_quant.py --deadline-s 115 \
  --out "$OUT/records/rq"
WARPS=$(python3 - "$OUT/records/rq/row_quant.json" <<'PY'
import json, sys
from collections import defaultdict
try:
    recs = json.load(open(sys.argv[1]))
except OSError:
    recs = []
tot = defaultdict(float)
for r in recs:
    c = r["config"]
    if c["M"] == 64 and c["variant"] != "unfused":
        tot[c["variant"]] += r["value"]
best = min(tot, key=tot.get) if tot else "w8"
print(best[1:] if best != "w4" and tot[best] < 0.97 * tot["w4"] else "8")
PY
)
echo "warps for the third profile: $WARPS"
T=jaxinfer.models.transformer
PD="python3 -u benchmarks/profile_decode.py --model dummy:llama-3.1-8b --backend pallas:fp8:fp8
  --batch 64 --ctx 512 --steps 10 --synthetic --top 18"
# shellcheck disable=SC2086
TAIL=22 run prof-off 105 $PD --out "$OUT/records/prof_off"
# shellcheck disable=SC2086
TAIL=22 run prof-swiglu 105 $PD --patch "$T.FUSE_SWIGLU_QUANT=True" --out "$OUT/records/prof_swiglu"
# shellcheck disable=SC2086
TAIL=22 run prof-swiglu-w$WARPS 105 $PD --patch "$T.FUSE_SWIGLU_QUANT=True" \
  --patch "pallas_kernels.matmul.row_quant.ROW_QUANT_WARPS=$WARPS" \
  --out "$OUT/records/prof_swiglu_w$WARPS"
