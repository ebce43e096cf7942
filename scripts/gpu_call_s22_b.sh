#!/usr/bin/env bash
# Session 22, call 2 (H200, limit ~590 s): (1) per-kernel time of Gemma 3 270M's decode step
# (dummy:gemma-3-270m, 32 rows at ctx 2048, synthetic KV) with the session-21 head-dim-256
# defaults vs the old ones (--patch both rules off), bf16 and FP8 KV: call 1's device pace
# said new > old end to end, the kernel A/Bs said the opposite; the trace shows which kernel
# moved. (2) the prepared SmolLM2-geometry decode (9/3/64), as scripts/gpu_call_next_s22_b.sh.
#   OUT=... bash scripts/gpu_call_s22_b.sh
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
PD="python3 -u benchmarks/profile_decode.py --model dummy:gemma-3-270m --batch 32 --ctx 2048
  --steps 20 --synthetic --top 12"
OFF="--patch pallas_kernels.paged_attention.decode_options.WIDE_HEAD_DIM=100000
  --patch pallas_kernels.paged_attention.fp8.FP8_WIDE_HEAD_DIM=100000"
for kv in bf16 fp8; do
  be=pallas; [ $kv = fp8 ] && be=pallas::fp8
  # shellcheck disable=SC2086
  TAIL=22 run prof-$kv-new 75 $PD --backend $be --out "$OUT/records/prof_${kv}_new"
  # shellcheck disable=SC2086
  TAIL=22 run prof-$kv-old 75 $PD --backend $be $OFF --out "$OUT/records/prof_${kv}_old"
done
PSB="python3 -u benchmarks/kernels/bench_paged_small_batch.py"
TAIL=14 run smol-bf16 130 $PSB --deadline-s 118 --heads 9/3/64 --checks 1x2048,16x2048,fp8:16x2048 \
  --tunes bt32,bt128,w8 --points 1x2048,4x2048,16x2048,64x2048,128x2048 \
  --out "$OUT/records/smol_bf16"
TAIL=14 run smol-fp8 100 $PSB --deadline-s 88 --no-checks --heads 9/3/64 --tunes bt32,w4 \
  --points fp8:1x2048,fp8:4x2048,fp8:16x2048,fp8:64x2048,fp8:128x2048 \
  --out "$OUT/records/smol_fp8"
