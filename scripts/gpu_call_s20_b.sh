#!/usr/bin/env bash
# Session 20, call 2 (H200, limit 590 s): FP8 KV split counts by wave efficiency
# (decode_options.wave_num_splits, FlashAttention's rule, variant kq8_bt64_w2_waves) against
# today's table (kq8_bt64_w2_tp512 at 4-63 rows, kq8_bt64_w2 from 64), one process each, at
# the batches where the two pick different counts (6-56) and two controls (16, 64: same
# count); then the rule with keep 0.95; then ncu again with XLA's autotuning and command
# buffers off (call 1's ncu run ended in a segfault during XLA's GEMM autotuning).
#   OUT=... bash scripts/gpu_call_s20_b.sh
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
PSB="python3 -u benchmarks/kernels/bench_paged_small_batch.py"
T=pallas_kernels.paged_attention.fp8.FP8_DECODE_BY_BATCH
OLD="$T=((64,'kq8_bt64_w2'),(4,'kq8_bt64_w2_tp512'),(1,'kq8'))"
NEW="$T=((4,'kq8_bt64_w2_waves'),(1,'kq8'))"
PTS=fp8:48x2048,fp8:24x2048,fp8:40x2048,fp8:56x2048,fp8:12x2048,fp8:8x2048,fp8:8x4096
PTS=$PTS,fp8:6x4096,fp8:16x2048,fp8:64x2048
TAIL=14 run fp8-new 165 $PSB --deadline-s 150 --points $PTS --patch "$NEW" \
  --out "$OUT/records/psb_fp8_new"
TAIL=14 run fp8-old 140 $PSB --deadline-s 125 --no-checks --points $PTS --patch "$OLD" \
  --out "$OUT/records/psb_fp8_old"
TAIL=10 run fp8-new95 100 $PSB --deadline-s 85 --no-checks --patch "$NEW" \
  --patch pallas_kernels.paged_attention.decode_options.WAVE_KEEP=0.95 \
  --points fp8:24x2048,fp8:40x2048,fp8:12x2048,fp8:8x2048,fp8:8x4096,fp8:6x4096 \
  --out "$OUT/records/psb_fp8_new95"
XLA_FLAGS="--xla_gpu_autotune_level=0 --xla_gpu_enable_command_buffer=" TAIL=20 run ncu 110 \
  bash scripts/ncu_decode.sh "$OUT/records/ncu_decode.csv" \
  --cases bf16:64x2048,fp8:64x2048,fp8:8x4096 --out "$OUT/records/ncu_checks.json"
