#!/usr/bin/env bash
# Session 46 call a (~5 min + start, any Hopper GPU): why session 46's run of gpu_call_s45_a.sh
# (H100) found 2 programs compiled on the second start of each model (8B FP8 + FP8 KV and
# Gemma 3 270M; CPU: 0) and 23 s of building beside 21 cached programs. The same commands
# with `-v` (one line per program: compiled / loaded and its seconds) and JAX's compiler
# logging (PERSISTENT COMPILATION CACHE MISS / hit, per module); Gemma 3 started three
# times (a miss on the third start too means a cache key that changes between processes).
# Its H100 run (RESULTS, session 46) found the 8B's pool sized 45,529 then 45,601 pages; run
# again after jaxinfer/kv_pages_memo.py, the 8B's second start should compile nothing.
#   OUT=... bash scripts/gpu_call_s46_a.sh
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/logs/nvidia-smi.txt"
export XDG_CACHE_HOME=/tmp/xdg JAX_DEBUG_LOG_MODULES=jax._src.compiler
PROMPT=$(python3 -c "print(' '.join(str(1000 + i % 5000) for i in range(2000)))")
EG="--load-format dummy --model gemma-3-270m --max-model-len 1024 --max-num-seqs 4
  --max-num-batched-tokens 1024 --prefill-buckets 1024 --decode-buckets 1,4 --token-ids
  --temperature 1 --seed 7 --max-tokens 24 -v"
E8="--load-format dummy --model llama-3.1-8b --quantization fp8 --kv-cache-dtype fp8
  --max-model-len 4096 --max-num-seqs 4 --max-num-batched-tokens 2048 --prefill-buckets 2048
  --decode-buckets 1,4 --token-ids --temperature 1 --seed 7 --max-tokens 24 -v"
keep='compiled \|loaded \|CACHE MISS\|cache hit\|Not writing\|took at least\|tokens in'
for i in 1 2 3; do
  # shellcheck disable=SC2086  # option lists
  TAIL=0 run "gemma-start$i" 150 $JI generate $EG "${PROMPT:0:4000}"
  grep "$keep" "$OUT/logs/gemma-start$i.log" | sed 's/ with key .*//' | cut -c1-160 \
    > "$OUT/logs/gemma-start$i.short"
done
for i in 1 2; do
  # shellcheck disable=SC2086
  TAIL=0 run "8b-start$i" 240 $JI generate $E8 "$PROMPT"
  grep "$keep" "$OUT/logs/8b-start$i.log" | sed 's/ with key .*//' | cut -c1-160 \
    > "$OUT/logs/8b-start$i.short"
done
for f in gemma-start2 gemma-start3 8b-start2; do
  echo "== $f"; grep -v "cache hit\|took at least" "$OUT/logs/$f.short"
done | tee "$OUT/logs/summary.txt"
pack
