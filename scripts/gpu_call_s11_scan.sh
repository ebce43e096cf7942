#!/usr/bin/env bash
# Session 11, call 4 (H200): the unrolled 8B FP8 decode step is one CUDA graph of ~800 nodes
# whose launch costs the host ~2 us a node (calls 2-3). Under lax.scan the layers are one loop
# body: with WHILE in XLA's command buffers the loop can run inside the graph (conditional
# nodes), so the host launches ~1/32 of the nodes. Times dispatch / sync / back to back of the
# scanned FP8 program per command-buffer setting (host trace of the last), and dumps the
# unrolled program's optimized HLO for the per-layer node count.
#   OUT=... bash scripts/gpu_call_s11_scan.sh
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
L="python3 -u benchmarks/decode_launch.py --batch 1 --ctx 512 --steps 30 --backend pallas:fp8"
XLA_FLAGS=--xla_enable_command_buffers_during_profiling=true TAIL=26 run scan-fp8 250 \
  $L --scan-layers --num-kv-pages 4096 --variants default,while_cond,while_cond_min1 --host-trace 5 --dump-hlo \
  --out "$OUT/records/scan_fp8"
TAIL=5 run unrolled-fp8 150 $L --variants default --dump-hlo --out "$OUT/records/unrolled_fp8"
