#!/usr/bin/env bash
# H200 session call: 8B decode (bf16, FP8; engine, device, pipelined) beside the torch.compile
# peer, a decode-step kernel profile with command buffers on, and the `jaxinfer compile`
# start-up measurement. Results packed into $OUT/results.tgz.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
R=/tmp/r; mkdir -p $R
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv
go() { local name=$1 secs=$2; shift 2; echo "=== $name"; timeout "$secs" "$@" > $R/$name.log 2>&1; echo "rc=$?" >> $R/$name.log; }
go decode 230 python3 benchmarks/gpu_decode.py --out $R/decode --backends pallas pallas:fp8 --batches 1 16 64 --budget-s 200
grep -A12 "TPOT eng" $R/decode.log; grep "tiny check\|ceilings" $R/decode.log
XLA_FLAGS=--xla_enable_command_buffers_during_profiling=true go profile 100 python3 benchmarks/profile_decode.py --out $R/prof --steps 20
grep -A14 "^== device-only" $R/prof.log | cut -c1-150; grep "^== engine" $R/prof.log | cut -c1-150
go startup 200 python3 benchmarks/startup_gpu.py --out $R/startup --variants bf16,fp8 --skip-cold --jobs 8
grep -v "compiling:" $R/startup.log | tail -8 | cut -c1-250
tar czf $OUT/results.tgz -C $R .
