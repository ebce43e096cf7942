#!/usr/bin/env bash
# H200 session call C: `jaxinfer compile` + warm start (bf16, FP8), the FP8/bf16 KV engine
# check, and 8B decode (bf16, FP8) beside the torch.compile peer. Packed into $OUT/results.tgz.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
R=/tmp/r; mkdir -p $R
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv
go() { local name=$1 secs=$2; shift 2; echo "=== $name"; timeout "$secs" "$@" > $R/$name.log 2>&1; echo "rc=$?" >> $R/$name.log; }
go startup 230 python3 benchmarks/startup_gpu.py --out $R/startup --variants bf16,fp8 --skip-cold --jobs 8
grep -v "compiling:" $R/startup.log | grep -v "^\s*$" | tail -7 | cut -c1-250
go fp8kv 130 python3 benchmarks/kernels/check_fp8_kv_engine.py --out $R/fp8kv
tail -14 $R/fp8kv.log | cut -c1-200
go decode 170 python3 benchmarks/gpu_decode.py --quick --out $R/decode --backends pallas pallas:fp8 --batches 1 16 --budget-s 150
grep -B2 -A8 "TPOT eng" $R/decode.log | cut -c1-200
tar czf $OUT/results.tgz -C $R .
