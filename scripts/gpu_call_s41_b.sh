#!/usr/bin/env bash
# Session 41 call b (either card, ~220 s): the variant stall (session 40 call b's command) with
# the background build at a 0.5 ms switch interval (runner_multi.BACKGROUND_SWITCH_INTERVAL_S,
# the engine now) against Python's 5 ms; both with the GC heap frozen as the server does.
# Call a's two rounds showed the stall is several one-step windows of 100-1,400 ms while the
# build traces: each GIL hand-back of a step waits up to a switch interval.
#   OUT=... bash scripts/gpu_call_s41_b.sh
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/logs/nvidia-smi.txt"
TAIL=8 run variant-stall-switch 280 python3 benchmarks/variant_stall.py \
  --out "$OUT/records/switch" --quantization fp8 --k 8 --streams 8 --decode-buckets 8,16 \
  --modes background,background_long_switch
