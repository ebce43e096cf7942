#!/usr/bin/env bash
# Session 5, device call 3 (H200): the bf16 8B suite's compile (-v phases) and offline
# 128/128 + 1000/1000 with async scheduling (the default now); TTFT with the Triton prefill
# kernel vs the Mosaic GPU varlen prefill kernel (--attention-backend pallas_mgpu, its own
# cache); the sampler variants at B=1/256. Output packed into $OUT/results.tgz.
#   OUT=... bash scripts/gpu_call_s5.sh
set -u
FINAL=${OUT:?set OUT}
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:. || exit 1
fi
export PYTHONPATH=${PYTHONPATH:-.} PYTHONUNBUFFERED=1
export OUT=/tmp/bench_out; mkdir -p "$OUT/logs" "$OUT/records"
pack() { tar czf "$FINAL/results.tgz.part" -C "$OUT" . && mv "$FINAL/results.tgz.part" "$FINAL/results.tgz"; }
LIMIT=60 COMPILE_EXTRA=-v bash scripts/bench_h200.sh bf16-offline; pack
ENGINE="--load-format dummy --model llama-3.1-8b --max-model-len 4352 --max-num-seqs 256
  --max-num-batched-tokens 8192 --max-prefill-seqs 64 --prefill-buckets 128,1024,4096,8192
  --decode-buckets 1,16,32,64,128,256 --num-kv-pages 36000"
JI="python3 -m jaxinfer.cli"
run() {  # id seconds command...
  local id=$1 secs=$2; shift 2; echo "=== $id: $*"; local t0=$SECONDS
  timeout "$secs" "$@" > "$OUT/logs/$id.log" 2>&1; echo "rc=$? wall=$((SECONDS - t0))s"
  grep -v "compiling\|it/s\]\|s/it\]" "$OUT/logs/$id.log" | tail -12 | cut -c1-200; pack
}
# shellcheck disable=SC2086
run TTFT-triton 90 $JI bench latency $ENGINE --cache-dir /tmp/jaxinfer-cache-bf16 \
  --out "$OUT/records" --prompt-lens 1024,4096 --concurrency 1 --input-len 128 --output-len 32
# shellcheck disable=SC2086
run compile-mgpu 120 $JI compile $ENGINE --attention-backend pallas_mgpu \
  --cache-dir /tmp/jaxinfer-cache-mgpu --modes sample --jobs 14 -v
# shellcheck disable=SC2086
run TTFT-mgpu 90 $JI bench latency $ENGINE --attention-backend pallas_mgpu \
  --cache-dir /tmp/jaxinfer-cache-mgpu --out "$OUT/records" --prompt-lens 1024,4096 \
  --concurrency 1 --input-len 128 --output-len 32
run sampling 120 python3 -u benchmarks/sampling_cost.py --out "$OUT/records" --modes variant \
  --batches 1 256 --iters 10 --trace-iters 5 --step-ms-b1 4.76 --step-ms-b256 18.5
echo "packed $(du -h "$FINAL/results.tgz" | cut -f1)"
