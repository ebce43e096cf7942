#!/usr/bin/env bash
# H200 session call D: `jaxinfer compile` + warm start (bf16, FP8), sampling cost, FP8 decode
# beside the torch.compile peer. Packed into $OUT/results.tgz.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
R=/tmp/r; mkdir -p $R
go() { local name=$1 secs=$2; shift 2; echo "=== $name"; timeout "$secs" "$@" > $R/$name.log 2>&1; echo "rc=$?" >> $R/$name.log; }
go startup 200 python3 benchmarks/startup_gpu.py --out $R/startup --variants bf16,fp8 --skip-cold --jobs 12
grep -v "compiling:" $R/startup.log | grep -v "^\s*$" | tail -7 | cut -c1-250
go sampling 70 python3 benchmarks/sampling_cost.py --out $R/sampling --step-ms-b1 6.6 --step-ms-b256 12.0
tail -24 $R/sampling.log | cut -c1-160
go decode 140 python3 benchmarks/gpu_decode.py --quick --out $R/decode --backends pallas:fp8 --batches 1 16 --budget-s 125
grep -B3 -A6 "TPOT eng" $R/decode.log | cut -c1-200; grep "^pallas" $R/decode.log | cut -c1-300
tar czf $OUT/results.tgz -C $R .
