# Sourced by the device-call scripts (scripts/gpu_*call*.sh): installs the wheels under .whl/
# (grpcio health/reflection and the grpcio/protobuf they need, missing on the device image)
# into /tmp/site, points OUT at a scratch folder whose contents `pack` tars into the caller's
# $OUT/results.tgz (the device tool returns at most 8 files), and defines `run` (one guarded,
# logged command) and the bench suites' 8B engine options ($OPTS).
FINAL=${OUT:?set OUT}
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:. || exit 1
fi
export PYTHONPATH=${PYTHONPATH:-.} PYTHONUNBUFFERED=1
export OUT=/tmp/bench_out; mkdir -p "$OUT/logs" "$OUT/records"
JI="python3 -m jaxinfer.cli"
OPTS="--load-format dummy --max-model-len 4352 --max-num-seqs 256 --max-num-batched-tokens 8192
  --max-prefill-seqs 64 --prefill-buckets 128,1024,4096,8192 --decode-buckets 1,16,32,64,128,256
  --num-kv-pages 36000"
pack() {  # after every step, so that a call killed at its limit still returns what ran
  tar czf "$FINAL/results.tgz.part" -C "$OUT" . && mv "$FINAL/results.tgz.part" "$FINAL/results.tgz"
}
run() {  # id seconds command...: logged under $OUT/logs/id.log, its tail printed, then packed
  local id=$1 secs=$2; shift 2; echo "=== $id: $*"; local t0=$SECONDS
  timeout "$secs" "$@" > "$OUT/logs/$id.log" 2>&1; echo "rc=$? wall=$((SECONDS - t0))s"
  grep -v "compiling\|it/s\]\|s/it\]\|^sampler\|^gather" "$OUT/logs/$id.log" | tail -${TAIL:-14} \
    | cut -c1-200; pack
}
pick_flags() {  # decode_launch.json: XLA_FLAGS of the variant with the lowest waited step,
  # if > 3 % under the default with the same argmax and logits within 1e-2; else nothing
  python3 - "$1" <<'PY'
import json, sys
v = json.load(open(sys.argv[1]))["variants"]
ok = {k: x for k, x in v.items() if "error" not in x and x["argmax_equal"]
      and x["logits_rel_err"] < 1e-2}
best = min(ok, key=lambda k: ok[k]["sync_ms"])
if best != "default" and ok[best]["sync_ms"] < 0.97 * ok["default"]["sync_ms"]:
    print(" ".join(f"--{k}={str(x).lower() if isinstance(x, bool) else x}"
                   for k, x in ok[best]["options"].items()))
PY
}
summarize_offline() {  # bench offline record files: one line each (tok/s, TPOT, done)
  python3 - "$@" <<'PY'
import json, sys
for f in sys.argv[1:]:
    r = {x["name"].split(".")[-1]: x["value"] for x in json.load(open(f))}
    print(f.split("/records/")[1][:60], "out tok/s %.0f  TPOT p50 %.2f ms  done %s / %s" % (
        r["output_throughput"], r["tpot_ms_p50"], r["completed"], r["num_requests"]))
PY
}
