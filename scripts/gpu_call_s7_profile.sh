#!/usr/bin/env bash
# Next session (H200): why the 8B bf16 1000/1000 offline step is ~39 ms when the device-only
# replay of 256 rows x 1,536 tokens is 19.8 ms (RESULTS "Peers' workload shapes", session 6).
# profile_decode.py at 256 rows x 1024-token prompts with the bench suites' 272-page block
# tables: device-only replay vs engine steps (device-busy vs wall per step from the trace),
# then the engine steps under cProfile. The engine's programs come from a compile cache
# filled in parallel first (serially they take > 150 s); --num-kv-pages is explicit (session
# 6's attempt without it sized the pool at max_num_seqs x max_model_len = 136 GiB in the
# compile and ran out of memory at run time -- the compile's sizing is being fixed).
#   OUT=... bash scripts/gpu_call_s7_profile.sh
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
ENG="--model dummy:llama-3.1-8b --load-format dummy --dtype bfloat16 --attention-backend pallas
  --max-model-len 4352 --max-num-seqs 256 --decode-buckets 256 --max-num-batched-tokens 1024
  --prefill-buckets 1024 --max-prefill-seqs 1 --num-kv-pages 36000"
# shellcheck disable=SC2086
run compile-prof 120 $JI compile $ENG --cache-dir /tmp/pc --jobs 14
TAIL=60 run profile-b256 200 python3 -u benchmarks/profile_decode.py --out "$OUT/records/prof" \
  --batch 256 --ctx 1024 --steps 10 --max-model-len 4352 --num-kv-pages 36000 --host-profile --cache-dir /tmp/pc
echo "packed $(du -h "$FINAL/results.tgz" | cut -f1)"
# Then the compile's own KV sizing (46b3eb1, unmeasured on a GPU): no --num-kv-pages, the
# 8192-token prefill bucket (the activation peak), an engine adopting the cache runs a
# 4096-token prompt and 256 streams.
VER="--model llama-3.1-8b --load-format dummy --max-model-len 4352 --max-num-seqs 256
  --max-num-batched-tokens 8192 --max-prefill-seqs 64 --prefill-buckets 1024,8192
  --decode-buckets 1,256 --cache-dir /tmp/kvc"
# shellcheck disable=SC2086
TAIL=20 run compile-kvsize 150 $JI compile $VER --modes sample --jobs 14 -v
# shellcheck disable=SC2086
TAIL=30 run latency-kvsize 170 $JI bench latency $VER --out "$OUT/records" --prompt-lens 4096 \
  --concurrency 1,256 --input-len 128 --output-len 64
nvidia-smi --query-gpu=memory.used,memory.total --format=csv > "$OUT/logs/nvidia-smi-end.txt"
pack
