#!/usr/bin/env bash
# Session 42 call a (either card; ~230 s, ~380 s on an H200 -- say which card):
# 1. session 41 call b, not run then (scripts/gpu_call_s41_b.sh): the variant stall
#    (Llama-3.1-8B FP8, k = 8, 8 greedy streams, a first top-p request at step 10) with the
#    background build at the engine's 0.5 ms switch interval against Python's 5 ms;
# 2. on an H200 only: session 34's FP8-KV decode sweep at 512 rows x 1,536 tokens
#    (scripts/gpu_call_s42_c.sh; the H200 point of the FP8-KV time ratio, issue #3).
# Both pack into the same $OUT/results.tgz (the second adds to the first's folder).
#   OUT=... bash scripts/gpu_call_s42_a.sh
set -u
bash scripts/gpu_call_s41_b.sh
bash scripts/gpu_call_s42_c.sh
