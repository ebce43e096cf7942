#!/usr/bin/env bash
# Session 8, issue #7: the nucleus kernel's compaction variants on the H200 (<= 200 s wall).
#   OUT=/path bash scripts/gpu_call_s8_compact.sh
# benchmarks/kernels/bench_nucleus_compact.py: capacity 2048 / 4096 / 8192 x num_warps 4 / 8
# x block 1024 / 512 against the full passes, S 256 and 1, logit std 3.75 (the sampler
# benchmark's), then 1 and 8; each checked against the full passes before it is timed.
set -u
export PYTHONPATH=.
mkdir -p "$OUT/r"
timeout 190 python3 -u benchmarks/kernels/bench_nucleus_compact.py --out "$OUT/r" \
    --deadline-s 170 2>&1 | tee "$OUT/r/s8_compact.log" | grep -v "^S="
tar czf "$OUT/results.tgz" -C "$OUT/r" . && rm -rf "$OUT/r"
