#!/usr/bin/env bash
# Session 19, call 4 (H200, ~7 min): the engine end to end with the new num_stages rule
# (16-bit KV, D 128: 4 stages past 3 programs an SM), 8B bf16 at batch 64, ctx 2048 (the
# attention's grid: 64 x 8 = 512 programs), against the old 5 stages (--patch) in a second
# process; the device pace (back-to-back replays) carries the A/B.
#   OUT=... bash scripts/gpu_call_s19_d.sh   (limit 560 s)
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
GD="python3 -u benchmarks/gpu_decode.py --backends pallas --batches 64 --ctx 2048 --steps 32 --quick"
TAIL=8 run e2e-s4 220 $GD --budget-s 200 --out "$OUT/records/e2e_s4"
TAIL=8 run e2e-s5 220 $GD --budget-s 200 \
  --patch pallas_kernels.paged_attention.decode_options.STAGES_MANY_PROGRAMS=5 \
  --out "$OUT/records/e2e_s5"
