#!/usr/bin/env bash
# Next session (H200, limit ~560 s; prepared in session 21, not run): the head-dim-256 decode
# defaults of session 21 end to end at Gemma 3 270M's shape (dummy:gemma-3-270m: random
# weights, 18 layers, 4/1/256 heads, 5 sliding-window layers a global one), bf16 and FP8 KV,
# a 32-row bucket at ctx 2048, against the old defaults (--patch both rules off) in a second
# process each; the device pace (back-to-back replays) carries the A/B.
#   OUT=... bash scripts/gpu_call_next_s22.sh
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
GD="python3 -u benchmarks/gpu_decode.py --model dummy:gemma-3-270m --batches 32 --ctx 2048
  --steps 32 --quick"
OFF="--patch pallas_kernels.paged_attention.decode_options.WIDE_HEAD_DIM=100000
  --patch pallas_kernels.paged_attention.fp8.FP8_WIDE_HEAD_DIM=100000"
# shellcheck disable=SC2086
TAIL=8 run g270-bf16-new 130 $GD --backends pallas --budget-s 115 --out "$OUT/records/bf16_new"
# shellcheck disable=SC2086
TAIL=8 run g270-bf16-old 130 $GD --backends pallas --budget-s 115 $OFF \
  --out "$OUT/records/bf16_old"
# shellcheck disable=SC2086
TAIL=8 run g270-fp8-new 130 $GD --backends pallas::fp8 --budget-s 115 \
  --out "$OUT/records/fp8_new"
# shellcheck disable=SC2086
TAIL=8 run g270-fp8-old 130 $GD --backends pallas::fp8 --budget-s 115 $OFF \
  --out "$OUT/records/fp8_old"
