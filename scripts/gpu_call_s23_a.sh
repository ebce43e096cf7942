#!/usr/bin/env bash
# Session 23, call 1 (H200, limit ~580 s): the residual adds fused into norm_quant_fp8 on the
# 8B shape (FP8 weights and KV, 64 rows, ctx 512, synthetic): per-kernel time of the decode
# step off / mid-layer add only (transformer.FUSE_RESIDUAL_ADD) / end-of-layer add carried
# into the next QKV site only (CARRY_LAYER_RESIDUAL) / both, one process each. The "off" run
# also dumps XLA's optimized HLO and keeps the decode module's copy instructions, to name
# the 64 memcpy32_post launches a step seen in session 22's profile.
#   OUT=... bash scripts/gpu_call_s23_a.sh
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
T=jaxinfer.models.transformer
PD="python3 -u benchmarks/profile_decode.py --model dummy:llama-3.1-8b --backend pallas:fp8:fp8
  --batch 64 --ctx 512 --steps 10 --synthetic --top 16"
# shellcheck disable=SC2086
XLA_FLAGS="--xla_dump_to=/tmp/hlo --xla_dump_hlo_as_text" \
  TAIL=20 run prof-off 125 $PD --out "$OUT/records/prof_off"
python3 - "$OUT/logs/hlo_copies.txt" <<'PY'
import glob, os, re, sys
files = sorted(glob.glob("/tmp/hlo/*after_optimizations.txt"), key=os.path.getsize)
out = open(sys.argv[1], "w")
for f in files[-3:]:  # the largest modules: the decode / prefill programs
    text = open(f).read()
    ops = re.findall(r"= \S+ (copy|copy-start|copy-done|dynamic-update-slice|bitcast)\(", text)
    out.write(f"== {os.path.basename(f)} {os.path.getsize(f)} bytes; ops: "
              f"{ {o: ops.count(o) for o in set(ops)} }\n")
    for line in text.splitlines():
        if re.search(r"= \S+ copy(-start)?\(", line):
            out.write(line.strip()[:300] + "\n")
out.close()
print(open(sys.argv[1]).read()[:3000])
PY
pack
for v in mid:True:False carry:False:True both:True:True; do
  IFS=: read -r name mid carry <<< "$v"
  # shellcheck disable=SC2086
  TAIL=20 run prof-$name 125 $PD --patch "$T.FUSE_RESIDUAL_ADD=$mid" \
    --patch "$T.CARRY_LAYER_RESIDUAL=$carry" --out "$OUT/records/prof_$name"
done
