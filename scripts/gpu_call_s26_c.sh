#!/usr/bin/env bash
# (Run once: the machine stopped answering mid-call and nothing came back; see gpu_call_s26_d.sh.)
# Session 26, call 2 (H200, ~500 s): call 1 (gpu_call_s26_a.sh) showed the RoPE + KV write
# kernel lowering the 8B FP8 step's device busy at 64 rows (4.209 -> 4.113 ms) and 1 row
# (2.809 -> 2.719) and Gemma 3 270M's (0.782 -> 0.672), but its device check ran out of time
# drawing 8.6 GB of caches with numpy before the first point (now drawn on the device).
# (1) check_rope_kv_write: the device check, then CUPTI µs a layer; (2) the engine end to end
# on the 8B shape, FP8 weights + FP8 KV, the RoPE kernel on, beside the torch.compile peer:
# multi-step decode (num_scheduler_steps 8) at batch 1 and 64, then one step a program at
# batch 1 (gpu_decode runs later variants at batch <= 16 only); (3) bench_row_quant's
# splitk4096 site: FUSE_SPLITK_RESIDUAL's kernel checked against XLA's epilogue + add.
#   OUT=... bash scripts/gpu_call_s26_c.sh
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
RK="--patch jaxinfer.layers.pallas_attention.ROPE_KV_WRITE_KERNEL=True"
TAIL=24 run rkw 120 python3 -u benchmarks/kernels/check_rope_kv_write.py --out "$OUT/records/rkw"
# shellcheck disable=SC2086
TAIL=10 run e2e8 330 python3 -u benchmarks/gpu_decode.py --batches 1 64 --steps 32 \
  --backends pallas:fp8:fp8/ms8 pallas:fp8:fp8 --budget-s 300 --quick \
  --peer .peers/torch_compile_llama.py $RK --out "$OUT/records/e2e8"
TAIL=12 run rq 60 python3 -u benchmarks/kernels/bench_row_quant.py --sites splitk4096 \
  --ms 1,64 --variants w16s --out "$OUT/records/rq"
grep -H -o '"tpot_ms_[a-z_]*": [0-9.]*\|"multi_step_windows": [0-9]*' "$OUT"/logs/e2e8*.log
