#!/usr/bin/env bash
# One device-machine call: the given suites of scripts/bench_h200.sh in turn (then any extra
# command lines given in $EXTRA, one per line), everything packed into $OUT/results.tgz (the
# device tool returns at most 8 files). Wheels under .whl/ (grpcio health/reflection and the
# grpcio/protobuf they need, missing on the device image) are installed into /tmp/site first.
#   bash scripts/gpu_bench_call.sh fp8 serve
set -u
# shellcheck source=scripts/gpu_call_lib.sh
source scripts/gpu_call_lib.sh
for suite in "$@"; do bash scripts/bench_h200.sh "$suite"; pack; done
if [ -n "${EXTRA:-}" ]; then
  while IFS= read -r line; do
    [ -z "$line" ] && continue
    echo "=== extra: $line"; (eval "$line") 2>&1 | tail -30 | cut -c1-220; pack
  done <<< "$EXTRA"
fi
echo "packed $(du -h "$FINAL/results.tgz" | cut -f1)"
