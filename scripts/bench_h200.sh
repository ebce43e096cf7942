#!/usr/bin/env bash
# The commands behind benchmarks/RESULTS.md "Peers' workload shapes (H200)": `jaxinfer bench`
# on random weights at the Llama-3.1 shapes. One suite per call of the device machine:
#
#   PYTHONPATH=. OUT=/path bash scripts/bench_h200.sh bf16    # compile, O1+O2, L1, peer
#   PYTHONPATH=. OUT=/path bash scripts/bench_h200.sh serve   # compile (bf16), S1
#   PYTHONPATH=. OUT=/path bash scripts/bench_h200.sh fp8     # compile, O3+O4+O5, L2
#   PYTHONPATH=. OUT=/path bash scripts/bench_h200.sh 70b     # compile, O6
#   PYTHONPATH=. OUT=/path bash scripts/bench_h200.sh async   # compile (bf16), latency sync
#                                                            # vs --async-scheduling, peer
#
# Every workload of a suite runs one engine configuration, compiled once ahead of time by
# `jaxinfer compile` into a cache each command then loads (a command that compiled its own
# programs would spend ~10 s per unrolled 8B program, serially). Each command writes its
# bench_*.json record file under $OUT/records and its log under $OUT/logs; `timeout` guards
# each so that one failure leaves the rest measured. Extra variables: JOBS (compile workers,
# default 14), LIMIT (seconds per offline run, default 75), COMPILE_EXTRA (more options for the
# compile step, e.g. -v for its phase times).
set -u
SUITE=${1:?usage: bench_h200.sh bf16|bf16-offline|serve|fp8|70b|async}
OUT=${OUT:?set OUT to the output folder}
export PYTHONUNBUFFERED=1
JOBS=${JOBS:-14} LIMIT=${LIMIT:-75}
BASE=${SUITE/serve/bf16}; BASE=${BASE/async/bf16}; BASE=${BASE/bf16-offline/bf16}
CACHE=${CACHE:-/tmp/jaxinfer-cache-$BASE}
mkdir -p "$OUT/records" "$OUT/logs"
JI="python3 -m jaxinfer.cli"

case $SUITE in
  bf16|bf16-offline|serve|fp8|async)
    # One configuration for every 8B workload: 4352-token contexts (2048/2048 and a
    # 4096-token prompt fit), 256 sequences, 8192-token prefill steps of up to 64 prompts,
    # 36,000 KV pages (576k tokens: 256 x 2000-token or 128 x 4096-token sequences).
    ENGINE="--load-format dummy --model llama-3.1-8b --max-model-len 4352 --max-num-seqs 256
      --max-num-batched-tokens 8192 --max-prefill-seqs 64 --prefill-buckets 128,1024,4096,8192
      --decode-buckets 1,16,32,64,128,256 --num-kv-pages 36000 --cache-dir $CACHE"
    [ "$SUITE" = fp8 ] && ENGINE="$ENGINE --quantization fp8" ;;
  70b)
    # 67 GiB of FP8 weights + 41 GiB of KV pool: above XLA's default 75 % of the device.
    export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}
    ENGINE="--load-format dummy --model llama-3.1-70b --quantization fp8 --max-model-len 2048
      --max-num-seqs 64 --max-num-batched-tokens 8192 --max-prefill-seqs 8
      --prefill-buckets 1024,8192 --decode-buckets 8,32,64 --num-kv-pages 8448
      --cache-dir $CACHE" ;;
  *) echo "unknown suite $SUITE (bf16, bf16-offline, serve, fp8, 70b, async)" >&2; exit 2 ;;
esac
# ENGINE_EXTRA: more engine options for every command of the suite, e.g.
# ENGINE_EXTRA=--async-scheduling (give such a run its own CACHE if it changes the programs).
ENGINE="$ENGINE ${ENGINE_EXTRA:-}"

go() {  # id seconds jaxinfer-arguments...: one command, logged, guarded
  local id=$1 secs=$2; shift 2
  echo "=== $id: jaxinfer $* (limit ${secs}s)"
  local t0=$SECONDS
  timeout "$secs" $JI "$@" > "$OUT/logs/$id.log" 2>&1
  local rc=$?
  echo "rc=$rc wall=$((SECONDS - t0))s" | tee -a "$OUT/logs/$id.log"
  grep -v "compiling\|it/s\]\|s/it\]" "$OUT/logs/$id.log" | tail -${TAIL:-22} | cut -c1-200
}

peer() {  # the PyTorch peer (torch.compile + CUDA graphs) at batch 1, in the same call
  [ -f .peers/torch_compile_llama.py ] || return 0
  echo "=== peer: torch_compile_llama.py --batch 1 --ctx 512 --steps 128"
  timeout 150 python3 .peers/torch_compile_llama.py --batch 1 --ctx 512 --steps 128 \
    --json "$OUT/records/peer_torch_compile.json" > "$OUT/logs/peer.log" 2>&1
  echo "rc=$?"; tail -5 "$OUT/logs/peer.log"
}

nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv,noheader \
  | tee "$OUT/logs/nvidia-smi.txt"
# shellcheck disable=SC2086  # ENGINE is a list of options
go compile-$SUITE 200 compile $ENGINE --modes sample --jobs "$JOBS" ${COMPILE_EXTRA:-}
[ -n "${ONLY_COMPILE:-}" ] && exit 0  # ONLY_COMPILE=1: the suite's compile step alone
OFF="bench offline $ENGINE --out $OUT/records --time-limit $LIMIT"
case $SUITE in
  bf16)
    go O1-O2 300 $OFF --input-len 128,1000 --output-len 128,1000 --num-prompts 1024,512
    go L1 170 bench latency $ENGINE --out "$OUT/records" --prompt-lens 128,1024,4096 \
      --concurrency 1,16,64,128 --input-len 128 --output-len 128
    peer ;;
  bf16-offline)  # O1 + O2 alone
    go O1-O2 300 $OFF --input-len 128,1000 --output-len 128,1000 --num-prompts 1024,512 ;;
  serve)  # gRPC server (started by the command) at 2 requests/s, Poisson arrivals
    go S1 200 bench serve $ENGINE --out "$OUT/records" --num-prompts 120 --random-input-len 128 \
      --random-output-len 128 --request-rate 2 --num-warmups 1 ;;
  fp8)
    go O3-O5 380 $OFF --input-len 128,1000,2048 --output-len 128,1000,2048 \
      --num-prompts 1024,512,128
    go L2 170 bench latency $ENGINE --out "$OUT/records" --prompt-lens 128,1024,4096 \
      --concurrency 1,16,64,128 --input-len 128 --output-len 128 ;;
  async)  # batch-1 and 64-stream TPOT, --no-async-scheduling vs the default (async), same
    # programs (before 7799cdf the default was synchronous and the second run passed
    # --async-scheduling)
    LAT="bench latency $ENGINE --out $OUT/records --prompt-lens 128 --concurrency 1,64
      --input-len 128 --output-len 128"
    go L-sync 150 $LAT --no-async-scheduling
    go L-async 150 $LAT
    peer ;;
  70b)
    go O6 330 $OFF --input-len 1000 --output-len 1000 --num-prompts 64 ;;
esac
