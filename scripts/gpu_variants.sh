#!/usr/bin/env bash
# Decode-step variants at batch 1 (8B shape): XLA dynamic-slice fusion, unrolled layers.
export PYTHONUNBUFFERED=1 PYTHONPATH=.
A="benchmarks/gpu_decode.py --quick --peer none --backends pallas --batches 1 --steps 24 --budget-s 100"
echo "=== scan (default)"; timeout 100 python3 $A --out /tmp/v1 2>&1 | tail -3
echo "=== scan + dynamic slice fusion"; XLA_FLAGS=--xla_gpu_enable_dynamic_slice_fusion=true timeout 100 python3 $A --out /tmp/v2 2>&1 | tail -3
echo "=== unrolled layers"; timeout 110 python3 $A --scan-layers false --out /tmp/v3 2>&1 | tail -3
