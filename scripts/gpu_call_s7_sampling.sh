#!/usr/bin/env bash
# Session 7, issue #7: the sampler candidates on the H200 (<= 100 s of wall time).
#   OUT=/path bash scripts/gpu_call_s7_sampling.sh
# 1. benchmarks/sampling_check.py: SELECT_METHOD "sort" == the TopK stages, the hash noise ==
#    numpy, draws against the filtered distribution (chi-square), seeded invariance S=1 vs
#    row 100 of 256 -- fresh random inputs; its own process (a fault there does not stop 2).
# 2. benchmarks/sampling_cost.py: the variant programs for top_p, all, top_k_top_p,
#    half_greedy_half_all, greedy at B 1 and 256, vocab 128256, configurations side by side:
#    threefry/topk (today's default), hash/topk (DRAW_METHOD "hash"), hash/sort (+
#    SELECT_METHOD "sort"), hash/sort/floor (+ NUCLEUS_FLOOR: the top-p search starts at a
#    floor known to pass); per-kernel breakdown of top_p B=256 and all B=1; table last.
set -u
OUT=${OUT:-benchmarks/results/s7_sampling}
mkdir -p "$OUT/records"
export PYTHONPATH=.
timeout 45 python3 -u benchmarks/sampling_check.py --out "$OUT/records" 2>&1 \
    | tee "$OUT/s7_sampling-check.log"
timeout 55 python3 -u benchmarks/sampling_cost.py --out "$OUT/records" --modes variant \
    --mixes top_p all top_k_top_p greedy half_greedy_half_all --batches 1 256 \
    --iters 10 --trace-iters 5 --step-ms-b1 4.8 --step-ms-b256 16 --buffer-method sort \
    --draw-method threefry,hash --select-method topk,sort --nucleus-floor 0,1 \
    --configs threefry/topk,hash/topk,hash/sort,hash/sort/floor --breakdown top_p:256 all:1 \
    --deadline-s 33 2>&1 | tee "$OUT/s7_sampling-cost.log"
