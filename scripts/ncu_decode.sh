#!/usr/bin/env bash
# Nsight Compute over the paged decode kernel (benchmarks/kernels/ncu_decode_probe.py): one
# process, every launch of a kernel named paged_decode* profiled; CSV to $1, then a table.
#   bash scripts/ncu_decode.sh OUT.csv --cases bf16:64x2048,fp8:64x2048
# Clocks left as they are (METHOD.md: --clock-control none). Exits 3 if ncu is missing.
# Only the probe's final launches are profiled (--profile-from-start off, the probe's
# cuProfilerStart/Stop): JAX's start-up and compiles run outside ncu's range.
set -u
csv=$1; shift
command -v ncu > /dev/null || { echo "ncu: not on PATH"; exit 3; }
ncu --clock-control none --target-processes all --profile-from-start off \
  --kernel-name regex:paged_decode \
  --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \
  --section LaunchStats --section SchedulerStats --section WarpStateStats \
  --section ComputeWorkloadAnalysis --section InstructionStats \
  --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio' \
  --csv --page details --log-file "$csv" \
  python3 benchmarks/kernels/ncu_decode_probe.py --profiler-range "$@"
rc=$?
python3 benchmarks/kernels/ncu_decode_probe.py --summarize "$csv" --out "${csv%.csv}.json"
exit $rc
