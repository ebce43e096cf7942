#!/usr/bin/env bash
# Session 22, call 3 (H200, limit ~500 s): the engine's KV write. Call 2's profiles (and the
# 8B ones of sessions 5 / 10) show the two scatter fusions a layer at 3-7 us for a few KB.
# (1) bench_kv_write.py: reference.write_kv_ref's methods (scatter / unique / rows) checked
# bit-identical, then timed at the 8B decode / prefill and Gemma 270M shapes, bf16 and FP8;
# (2) per-kernel time of Gemma 3 270M's decode step (32 rows, ctx 2048) with each method
# (--patch reference.KV_WRITE_METHOD), FP8 then bf16 KV.
#   OUT=... bash scripts/gpu_call_s22_c.sh
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
TAIL=16 run kvw 100 python3 -u benchmarks/kernels/bench_kv_write.py --deadline-s 80 \
  --out "$OUT/records/kvw"
PD="python3 -u benchmarks/profile_decode.py --model dummy:gemma-3-270m --batch 32 --ctx 2048
  --steps 20 --synthetic --top 8"
for kv in fp8 bf16; do
  be=pallas; [ $kv = fp8 ] && be=pallas::fp8
  for m in scatter unique rows; do
    # shellcheck disable=SC2086
    TAIL=12 run prof-$kv-$m 70 $PD --backend $be \
      --patch "pallas_kernels.paged_attention.reference.KV_WRITE_METHOD=\"$m\"" \
      --out "$OUT/records/prof_${kv}_$m"
  done
done
