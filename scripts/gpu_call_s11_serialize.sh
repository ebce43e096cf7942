#!/usr/bin/env bash
# Session 11, call 3 (H200): call 2 found the 8B decode step is one CUDA graph whose
# cuGraphLaunch takes 1.5 ms of host time (~2 us a node). Does the graph's node ordering
# change that (XLA's xla_gpu_command_buffer_scheduling_mode: LHS default, SERIALIZE,
# CONCURRENT)? The probe's small chains, then the FP8 and bf16 decode programs per mode
# (host trace of the SERIALIZE program, command buffers kept on under the profiler).
#   OUT=... bash scripts/gpu_call_s11_serialize.sh
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
TAIL=20 run probe 150 python3 -u benchmarks/dispatch_probe.py --out "$OUT/records/probe"
L="python3 -u benchmarks/decode_launch.py --batch 1 --ctx 512 --steps 30"
XLA_FLAGS=--xla_enable_command_buffers_during_profiling=true TAIL=32 run mode-fp8 200 \
  $L --backend pallas:fp8 --variants default,concurrent,serialize --host-trace 5 \
  --out "$OUT/records/mode_fp8"
TAIL=6 run mode-bf16 150 $L --backend pallas --variants default,serialize \
  --out "$OUT/records/mode_bf16"
