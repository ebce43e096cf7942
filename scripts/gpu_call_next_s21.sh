#!/usr/bin/env bash
# Next session, first call (H200, limit 590 s; prepared in session 20, not run): Nsight Compute
# counters of the FP8 and bf16 decode kernels at B64 ctx2048 (where FP8 takes 0.63 of bf16's
# time instead of 0.5). Session 20's two tries gave no counters: a segfault in XLA's GEMM
# autotuning under ncu, then (autotuning and command buffers off) no kernel reached within
# 110 s -- ncu intercepts every CUDA call of JAX's start-up. This try profiles only the final
# launches (--profile-from-start off + cuProfilerStart/Stop in the probe), gives it 540 s, one
# launch a case, and only the two cases. ncu works on Firecracker machines only (uname -r
# shows "-fc"); on gVisor the script stops at once.
#   OUT=... bash scripts/gpu_call_next_s21.sh
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
uname -r | grep -q -- "-fc" || { echo "not Firecracker: ncu cannot read counters here"; exit 0; }
XLA_FLAGS="--xla_gpu_autotune_level=0 --xla_gpu_enable_command_buffer=" TAIL=20 run ncu 540 \
  bash scripts/ncu_decode.sh "$OUT/records/ncu_decode.csv" --launches 1 \
  --cases fp8:64x2048,bf16:64x2048 --out "$OUT/records/ncu_checks.json"
