#!/usr/bin/env bash
# Session 16 (H200): programmatic dependent launch and command-buffer update modes.
# (1) benchmarks/kernels/pdl_probe.py: chains of 32 dependent M = 1 GEMMs (our FP8 W8A8 and
#     XLA's bf16, 8B o_proj shape) per XLA option set; PTX of the PDL build checked for
#     griddepcontrol in every kernel (do our Pallas kernels get it?).
# (2) decode_launch.py: the 8B FP8 batch-1 decode program compiled per option set (PDL on /
#     off, command-buffer update modes), logits against the default's, dispatch / sync / b2b.
# (3) the engine's TPOT at batch 1 / 16 (gpu_decode.py) with the option set of the lowest
#     waited step (if > 3 % under the default with the same argmax) as XLA_FLAGS, and without.
#   OUT=... bash scripts/gpu_call_s16_pdl.sh   (limit 600 s)
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
TAIL=14 run pdl-probe 150 python3 -u benchmarks/kernels/pdl_probe.py --dump \
  --out "$OUT/records/pdl_probe"
TAIL=14 run launch-fp8 200 python3 -u benchmarks/decode_launch.py --batch 1 --ctx 512 \
  --steps 30 --backend pallas:fp8 \
  --variants default,pdl_off,pdl,pdl_launch,upd_always,upd_skip_temp,upd_skip_profiled,pdl_skip_temp \
  --out "$OUT/records/launch_fp8"
FLAGS=$(pick_flags "$OUT/records/launch_fp8/decode_launch.json")
echo "picked XLA_FLAGS: '${FLAGS}'"
if [ -n "$FLAGS" ]; then
  E="python3 -u benchmarks/gpu_decode.py --quick --peer none --backends pallas:fp8 --batches 1 16
    --steps 32 --budget-s 100"
  XLA_FLAGS="$FLAGS" TAIL=4 run e2e-picked 115 $E --out "$OUT/records/e2e_picked"
  TAIL=4 run e2e-default 115 $E --out "$OUT/records/e2e_default"
  grep -H -o '"tpot_ms_[a-z]*": [0-9.]*' "$OUT"/logs/e2e-*.log
fi
