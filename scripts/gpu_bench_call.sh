#!/usr/bin/env bash
# One device-machine call: the given suites of scripts/bench_h200.sh in turn (then any extra
# command lines given in $EXTRA, one per line), everything packed into $OUT/results.tgz (the
# device tool returns at most 8 files). Wheels under .whl/ (grpcio health/reflection and the
# grpcio/protobuf they need, missing on the device image) are installed into /tmp/site first.
#   bash scripts/gpu_bench_call.sh fp8 serve
set -u
FINAL=${OUT:?set OUT}
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:. || exit 1
fi
export PYTHONPATH=${PYTHONPATH:-.}
export OUT=/tmp/bench_out; mkdir -p "$OUT/logs"
pack() {  # after every step, so that a call killed at its limit still returns what ran
  tar czf "$FINAL/results.tgz.part" -C "$OUT" . && mv "$FINAL/results.tgz.part" "$FINAL/results.tgz"
}
for suite in "$@"; do bash scripts/bench_h200.sh "$suite"; pack; done
if [ -n "${EXTRA:-}" ]; then
  while IFS= read -r line; do
    [ -z "$line" ] && continue
    echo "=== extra: $line"; (eval "$line") 2>&1 | tail -30 | cut -c1-220; pack
  done <<< "$EXTRA"
fi
echo "packed $(du -h "$FINAL/results.tgz" | cut -f1)"
