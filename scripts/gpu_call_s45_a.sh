#!/usr/bin/env bash
# Session 45 call a (~5 min + start, any Hopper GPU): JAX's persistent compilation cache, on
# by default since session 45 for generate / chat / serve (jaxinfer/xla_cache.py), with the
# GPU kernels in the programs: a second start of the same command compiles nothing and gives
# the first start's sampled tokens (temperature 1, engine seed 7: a change in the logits
# shows). Llama-3.1-8B FP8 weights + FP8 KV (random weights): a 2,000-token prompt (the
# 2048-token prefill bucket: Mosaic GPU prefill attention and W8A8 GEMMs) then batch-1
# decode (Triton FP8 GEMMs, FP8-KV decode kernel); then Gemma 3 270M's shape in bf16 (head
# dim 256, sliding layers). The cache at its default place under $XDG_CACHE_HOME.
#   OUT=... bash scripts/gpu_call_s45_a.sh
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/logs/nvidia-smi.txt"
export XDG_CACHE_HOME=/tmp/xdg
PROMPT=$(python3 -c "print(' '.join(str(1000 + i % 5000) for i in range(2000)))")
E8="--load-format dummy --model llama-3.1-8b --quantization fp8 --kv-cache-dtype fp8
  --max-model-len 4096 --max-num-seqs 4 --max-num-batched-tokens 2048 --prefill-buckets 2048
  --decode-buckets 1,4 --token-ids --temperature 1 --seed 7 --max-tokens 24"
EG="--load-format dummy --model gemma-3-270m --max-model-len 1024 --max-num-seqs 4
  --max-num-batched-tokens 1024 --prefill-buckets 1024 --decode-buckets 1,4 --token-ids
  --temperature 1 --seed 7 --max-tokens 24"
for i in 1 2; do
  # shellcheck disable=SC2086  # option lists
  TAIL=3 run "8b-start$i" 240 $JI generate $E8 "$PROMPT"
  # shellcheck disable=SC2086
  TAIL=3 run "gemma-start$i" 150 $JI generate $EG "${PROMPT:0:4000}"
done
for m in 8b gemma; do  # the generated ids (stdout's last line) of both starts
  a=$(grep -E "^[0-9 ]+$" "$OUT/logs/$m-start1.log" | tail -1 | cut -c1-400)
  b=$(grep -E "^[0-9 ]+$" "$OUT/logs/$m-start2.log" | tail -1 | cut -c1-400)
  [ -n "$a" ] && [ "$a" = "$b" ] && echo "$m: same tokens: $a" || echo "$m: DIFFER: $a | $b"
  grep -h "building" "$OUT/logs/$m-start1.log" "$OUT/logs/$m-start2.log" | cut -c1-200
done | tee "$OUT/logs/summary.txt"
du -sh /tmp/xdg/jaxinfer/xla | tee -a "$OUT/logs/summary.txt"
pack
