#!/usr/bin/env bash
# Next session (H200, limit ~560 s; prepared in session 22, not run): the mid-layer residual
# add fused into the gate/up site's norm_quant_fp8 (transformer.FUSE_RESIDUAL_ADD, off by
# default) on the 8B shape, FP8 weights and KV: (1) per-kernel time of the decode step at 64
# rows (profile_decode, on vs off: the 62 loop_add_fusion calls a step at ~2.25 us in session
# 22's profile should drop to 31, norm_quant_fp8 grow by less); (2) engine TPOT at batch 1
# and 64, on vs off in two processes. Adopt (flip the default) if the device time drops and
# the greedy tokens match.
#   OUT=... bash scripts/gpu_call_next_s23_b.sh
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
ON="--patch jaxinfer.models.transformer.FUSE_RESIDUAL_ADD=True"
PD="python3 -u benchmarks/profile_decode.py --model dummy:llama-3.1-8b --backend pallas:fp8:fp8
  --batch 64 --ctx 512 --steps 10 --synthetic --top 14"
# shellcheck disable=SC2086
TAIL=18 run prof-on 130 $PD $ON --out "$OUT/records/prof_on"
# shellcheck disable=SC2086
TAIL=18 run prof-off 130 $PD --out "$OUT/records/prof_off"
GD="python3 -u benchmarks/gpu_decode.py --backends pallas:fp8:fp8 --batches 1 64 --steps 32
  --budget-s 120 --peer none"
# shellcheck disable=SC2086
TAIL=8 run e2e-on 140 $GD $ON --out "$OUT/records/e2e_on"
# shellcheck disable=SC2086
TAIL=8 run e2e-off 140 $GD --out "$OUT/records/e2e_off"
