#!/usr/bin/env bash
# Session 34 (~300 s, an H100 or H200; say which): session 33's unexplained qkv slowdown.
# With mgpu_gemm.FILL_TILE_N = 64 the o / down GEMMs of the 512-row FP8 + FP8-KV step got
# 128 x 128 tiles and faster, but qkv -- whose tiles the rule leaves alone -- read 33-67 us a
# step slower (three pairs, two cards). Hypothesis: power. With every SM busy on FP8 wgmma
# the card draws more and lowers its SM clock, so an unchanged kernel runs slower. The same
# profiles (default / off / default, 40 steps each) with nvidia-smi sampling SM clock, power
# and the clock event reasons every 50 ms; per run, the samples at >= 90 % utilisation.
#   OUT=... bash scripts/gpu_call_s34_c.sh
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
nvidia-smi --query-gpu=name,memory.total,power.limit,clocks.max.sm --format=csv,noheader \
  | tee "$OUT/logs/nvidia-smi.txt"
R=clocks_event_reasons.active  # older drivers: clocks_throttle_reasons.active
nvidia-smi --query-gpu=$R --format=csv > /dev/null 2>&1 || R=clocks_throttle_reasons.active
nvidia-smi --query-gpu=timestamp,utilization.gpu,clocks.sm,power.draw,$R \
  --format=csv,noheader,nounits -lms 50 > "$OUT/logs/smi.csv" 2>&1 &
SMI=$!
P="python3 -u benchmarks/profile_decode.py --backend pallas:fp8:fp8 --batch 512 --ctx 1536
  --steps 40 --synthetic --num-kv-pages 51200"
for id in default off default2; do
  patch=""; [ "$id" = off ] && patch="--patch pallas_kernels.matmul.mgpu_gemm.FILL_TILE_N=None"
  date +"%Y/%m/%d %H:%M:%S.%3N $id start" >> "$OUT/logs/windows.txt"
  # shellcheck disable=SC2086  # option lists
  TAIL=4 run "prof-$id" 110 $P --out "$OUT/records/prof512_$id" $patch
  date +"%Y/%m/%d %H:%M:%S.%3N $id end" >> "$OUT/logs/windows.txt"
done
kill $SMI
python3 - "$OUT/logs/smi.csv" "$OUT/logs/windows.txt" <<'PY' | tee "$OUT/logs/clocks.txt"
import datetime as dt, statistics as st, sys
t = lambda s: dt.datetime.strptime(s.strip(), "%Y/%m/%d %H:%M:%S.%f")
rows = []
for line in open(sys.argv[1]):
    f = [x.strip() for x in line.split(",")]
    try:
        rows.append((t(f[0]), float(f[1]), float(f[2]), float(f[3]), f[4]))
    except (ValueError, IndexError):
        pass
w = {}
for line in open(sys.argv[2]):
    d, h, name, edge = line.split()
    w.setdefault(name, {})[edge] = t(d + " " + h)
for name, e in w.items():
    busy = [r for r in rows if e["start"] <= r[0] <= e["end"] and r[1] >= 90]
    if not busy:
        print(name, "no busy samples"); continue
    clk, pw = [r[2] for r in busy], [r[3] for r in busy]
    print(f"{name}: {len(busy)} samples >= 90 % util, SM clock mean {st.mean(clk):.0f} min "
          f"{min(clk):.0f} MHz, power mean {st.mean(pw):.0f} max {max(pw):.0f} W, reasons "
          f"{sorted(set(r[4] for r in busy))}")
PY
grep -H "device busy\|mosaic_gpu_kernel: \[0\]" "$OUT"/logs/prof-*.log | cut -c1-160
pack
