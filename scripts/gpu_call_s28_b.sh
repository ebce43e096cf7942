#!/usr/bin/env bash
# Session 28, call 2 (~150 s): where check_rope_kv_write's failures of call 1 come from
# (benchmarks/kernels/diag_rope_kv_write.py): FP8 rounding ties of XLA and Triton vs the
# host's round-to-nearest-even; q at the failing points from the kernel, the kernel
# interpreted on the GPU, XLA on the GPU and the CPU reference.
#   OUT=... bash scripts/gpu_call_s28_b.sh
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
TAIL=12 run diag 200 python3 -u benchmarks/kernels/diag_rope_kv_write.py --out "$OUT/records/diag"
# XLA on the GPU drops f32 -> bf16 -> f32 round trips (xla_allow_excess_precision, on by
# default); the CPU and the kernel keep them: the same points with it off
XLA_FLAGS="--xla_allow_excess_precision=false" TAIL=12 run diag-noexcess 200 python3 -u \
  benchmarks/kernels/diag_rope_kv_write.py --out "$OUT/records/diag_noexcess"
for f in "$OUT"/logs/diag*.log; do echo "== $f"; grep '^{' "$f" | python3 -c "
import json, sys
for line in sys.stdin:
    r = json.loads(line)
    print(r['point'], r['kv'], r['pages'], {k: (v['max_steps'], v['frac']) for k, v in r.items() if k.endswith('_vs_cpu') or k == 'triton_vs_xla'}, r['examples'][:2])
"; done
