#!/usr/bin/env bash
# Session 36 call 1 (~480 s, an H200 wanted; says which card ran): session 34's prepared
# calls a (FP8-KV decode sweep at B512 ctx1536 and B128 ctx2048) and c (512-row step
# profiles with SM clock / power sampled) in one machine start.
#   OUT=... bash scripts/gpu_call_s36_a.sh
set -u
bash scripts/gpu_call_s34_a.sh
mv "$OUT/results.tgz" "$OUT/results_a.tgz" 2>/dev/null
bash scripts/gpu_call_s34_c.sh
