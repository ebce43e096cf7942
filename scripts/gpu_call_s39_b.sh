#!/usr/bin/env bash
# Session 39 call b (~60 s; either card, says which): call a's sampler A/B again with the
# engine's tunables on both sides (call a timed ours with benchmarks/sampling_cost.py's old
# default draw, threefry, and the file before bad words with hash). Mixes greedy,
# temperature, logit_bias (a full 300-entry table), bad_words (a full 128 x 16-token table)
# at B 1 and 256, vocab 128256: ours, then 110c6a0~1's sampler (`git show
# 110c6a0~1:jaxinfer/sampling.py > .peers/sampling_before_bad_words.py`), twice each in
# alternation (a drift between processes shows as a difference between the repeats).
#   OUT=... bash scripts/gpu_call_s39_b.sh
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/logs/nvidia-smi-b.txt"
MIXES="greedy temperature logit_bias bad_words"
for i in 1 2; do
  TAIL=10 run "sampling-cost-$i" 120 python3 benchmarks/sampling_cost.py --mixes $MIXES \
    --out "$OUT/records/sampling_$i"
  TAIL=10 run "sampling-cost-before-$i" 120 python3 benchmarks/sampling_cost.py --mixes $MIXES \
    --modes variant --sampler-file .peers/sampling_before_bad_words.py \
    --out "$OUT/records/sampling_before_$i"
done
