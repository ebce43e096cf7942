#!/usr/bin/env bash
# Session 8, issue #7: the nucleus kernel's bracket compaction (threshold_search.COMPACT) on
# the H200 (<= 240 s of wall time).
#   OUT=/path bash scripts/gpu_call_s8_sampling.sh   (COMPACTS=0,8192: the capacities timed)
# 1. benchmarks/sampling_check.py: every device check of session 7 (now on the compacting
#    kernel, the default) + check 5: compacted cut == the full passes' cut, kept tokens ==
#    a float64 sort, a row alone == in the batch; passes over the row and copies reported.
# 2. benchmarks/sampling_cost.py: the sampler programs at B 1 and 256, vocab 128256, COMPACT
#    0 (every pass reads the row; B < 64 takes the split mode) / 1024 / 2048 / 4096, with the
#    session-7 defaults (hash noise, sort selection, nucleus floor); per-kernel breakdown of
#    top_p at B 256 and 1; table last.
set -u
FINAL=${OUT:-benchmarks/results/s8_sampling}
OUT=/tmp/s8_sampling  # packed into $FINAL/results.tgz (the device tool returns 8 files)
mkdir -p "$OUT/records"
export PYTHONPATH=.
timeout 70 python3 -u benchmarks/sampling_check.py --out "$OUT/records" 2>&1 \
    | tee "$OUT/s8_sampling-check.log"
timeout 160 python3 -u benchmarks/sampling_cost.py --out "$OUT/records" --modes variant \
    --mixes top_p all top_k_top_p temperature logprobs greedy half_greedy_half_all \
    --batches 1 256 --iters 10 --trace-iters 5 --step-ms-b1 4.8 --step-ms-b256 16 \
    --buffer-method sort --draw-method hash --select-method sort --nucleus-floor 1 \
    --compact "${COMPACTS:-0,1024,2048,4096}" --breakdown top_p:256 top_p:1 \
    --deadline-s 130 2>&1 | tee "$OUT/s8_sampling-cost.log" | grep -v "^variant"
tar czf "$FINAL/results.tgz" -C "$OUT" .
