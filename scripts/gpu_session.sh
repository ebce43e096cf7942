#!/usr/bin/env bash
# One device-machine call that runs every GPU benchmark of this repo in turn, each under its
# own time guard, and packs all results into $OUT/results.tgz (the device tool returns at
# most 8 files). Usage on the device machine: PYTHONPATH=. bash scripts/gpu_session.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
RES=/tmp/gpu_results; mkdir -p "$RES"
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv | tee "$RES/nvidia-smi.txt"
run() {  # name seconds command...
  local name=$1 secs=$2; shift 2
  echo "=== $name (limit ${secs}s)"
  timeout "$secs" "$@" > "$RES/$name.log" 2>&1; echo "rc=$?" >> "$RES/$name.log"
  tail -25 "$RES/$name.log"
}
run gpu_decode "${DECODE_S:-300}" python3 benchmarks/gpu_decode.py --out "$RES/gpu_decode" --budget-s "$(( ${DECODE_S:-300} - 30 ))"
[ -f benchmarks/kernels/bench_paged_prefill.py ] && \
  run paged_prefill "${PREFILL_S:-90}" python3 benchmarks/kernels/bench_paged_prefill.py --out "$RES/paged_prefill" --deadline-s "$(( ${PREFILL_S:-90} - 15 ))"
[ -f benchmarks/startup_gpu.py ] && \
  run startup_gpu "${STARTUP_S:-170}" python3 benchmarks/startup_gpu.py --out "$RES/startup_gpu" --skip-cold
tar -czf "${OUT:-/tmp}/results.tgz" -C "$RES" .
echo "packed $(du -h "${OUT:-/tmp}/results.tgz" | cut -f1)"
