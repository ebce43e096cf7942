#!/usr/bin/env bash
# Session 27, call 1 (H200, ~560 s): session 26's call 2 (gpu_call_s26_c.sh) again, with the
# device check fixed: check_rope_kv_write compared the whole 2 x 2 GB caches in numpy (int64
# copies, ~50 GB of host temporaries: the likely reason that machine stopped answering); it
# now compares the written rows and tests the rest bit-equal on the device.
# (1) check_rope_kv_write: device check, then CUPTI µs a layer, kernel vs XLA; (2) the engine
# end to end on the 8B shape, FP8 weights + FP8 KV, the RoPE kernel on, beside the
# torch.compile peer in the same process: multi-step decode (num_scheduler_steps 8) at batch 1
# and 64, then one step a program at batch 1; (3) bench_row_quant's splitk4096 site.
#   OUT=... bash scripts/gpu_call_s27_a.sh
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
RK="--patch jaxinfer.layers.pallas_attention.ROPE_KV_WRITE_KERNEL=True"
TAIL=24 run rkw 150 python3 -u benchmarks/kernels/check_rope_kv_write.py --out "$OUT/records/rkw"
# shellcheck disable=SC2086
TAIL=10 run e2e8 330 python3 -u benchmarks/gpu_decode.py --batches 1 64 --steps 32 \
  --backends pallas:fp8:fp8/ms8 pallas:fp8:fp8 --budget-s 300 --quick \
  --peer .peers/torch_compile_llama.py $RK --out "$OUT/records/e2e8"
TAIL=12 run rq 60 python3 -u benchmarks/kernels/bench_row_quant.py --sites splitk4096 \
  --ms 1,64 --variants w16s --out "$OUT/records/rq"
grep -H -o '"tpot_ms_[a-z_]*": [0-9.]*\|"multi_step_windows": [0-9]*' "$OUT"/logs/e2e8*.log
