#!/usr/bin/env bash
# Next session (H200): why the 8B FP8 batch-1 decode program takes 4.67 ms synchronously but
# 3.25 ms back to back (session 10, call 6; NOTES_matmul "Session 10"), and whether XLA's
# command buffers are what differs. gpu_decode.py's replay (fixed inputs, no host work) for
# bf16 and FP8 at batch 1 with the default XLA flags, then FP8 with command buffers off and
# with XLA's minimum graph size at 1; finally a trace of the FP8 step with command buffers
# kept on under the profiler (the kernel gaps of the real step).
#   OUT=... bash scripts/gpu_call_next_fp8_launch.sh
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
R="python3 -u benchmarks/gpu_decode.py --quick --peer none --batches 1 --steps 24 --budget-s 100"
TAIL=3 run replay-fp8 110 $R --backends pallas:fp8 --out "$OUT/records/fp8"
TAIL=3 run replay-bf16 110 $R --backends pallas --out "$OUT/records/bf16"
XLA_FLAGS=--xla_gpu_enable_command_buffer= TAIL=3 run replay-fp8-nocb 110 $R \
  --backends pallas:fp8 --out "$OUT/records/fp8_nocb"
XLA_FLAGS=--xla_gpu_graph_min_graph_size=1 TAIL=3 run replay-fp8-mg1 110 $R \
  --backends pallas:fp8 --out "$OUT/records/fp8_mg1"
XLA_FLAGS=--xla_enable_command_buffers_during_profiling=true TAIL=40 run prof-fp8-cb 150 \
  python3 -u benchmarks/profile_decode.py --synthetic --ctx 512 --steps 10 --top 30 \
  --backend pallas:fp8 --batch 1 --out "$OUT/records/prof_fp8_cb"
grep -ho '"tpot_ms_[a-z]*": [0-9.]*' "$OUT"/logs/replay-*.log
