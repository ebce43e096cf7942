#!/usr/bin/env bash
# Session 11, call 2 (H200): where the 2.4 ms of host time to dispatch the 8B decode program
# goes (call 1: the same for bf16 and FP8, 2.4 ms with XLA's command buffers on, 5-6 off).
# dispatch_probe.py: per-argument and per-kernel dispatch cost of small programs; then the
# FP8 decode program's host-side trace events (command buffers kept on under the profiler).
#   OUT=... bash scripts/gpu_call_s11_dispatch.sh
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
TAIL=20 run probe 120 python3 -u benchmarks/dispatch_probe.py --out "$OUT/records/probe"
XLA_FLAGS=--xla_enable_command_buffers_during_profiling=true TAIL=40 run trace-fp8 200 \
  python3 -u benchmarks/decode_launch.py --batch 1 --ctx 512 --steps 30 --backend pallas:fp8 \
  --variants default --host-trace 5 --out "$OUT/records/trace_fp8"
