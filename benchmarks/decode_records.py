"""gpu_decode.py / profile_decode.py summaries -> benchmark records (one JSON list), as
benchmarks/results keeps them.

    python benchmarks/decode_records.py --out benchmarks/results/NAME.json \
        --command "OUT=... bash scripts/<call>.sh" [--set session=14 --set call=1] \
        RUN_LABEL=path/to/gpu_decode_summary.json [...]

Every backend and batch a summary timed gives three records, ``gpu_decode_tpot_ms_engine``
(median wall time of an engine step with the whole batch decoding), ``_device`` (the decode
program and sampler called and waited for) and ``_pipelined`` (back to back, the device pace),
in ms, with config {run label, model, backend, batch, ctx, steps, weight_bytes, patches, and the
--set pairs}. A profile_decode.py summary (``profile_summary.json``) gives one record,
``profile_decode_device_busy_us_per_step`` (µs of kernels a replayed step), with config {run,
model, backend, batch, ctx, steps, synthetic, patches, wall_ms_per_step, span_us_per_step,
classes_us_per_step, top_kernels, by_position_us_per_step where the summary has it, the --set
pairs}. Raises SystemExit naming a summary that is
missing or neither script's.
"""
import argparse
import datetime
import json
from pathlib import Path

KINDS = ("engine", "device", "pipelined")
JAX_ON_DEVICE = "0.11.2"  # the GPU machines' jax (profile_decode's summary does not say)


def records(label: str, summary: dict, meta: dict, command: str) -> list[dict]:
    out = []
    for backend, r in summary.items():
        if not (isinstance(r, dict) and "weight_bytes" in r):
            continue
        for key, x in r.items():
            if not (key.startswith("b") and key[1:].isdigit() and isinstance(x, dict)):
                continue
            cfg = {"run": label, "backend": backend, "batch": int(key[1:]),
                   "weight_bytes": r["weight_bytes"], "patches": summary.get("patches", {}),
                   **{k: summary[k] for k in ("model", "ctx", "steps") if k in summary},
                   **meta}
            for kind in KINDS:
                if f"tpot_ms_{kind}" in x:
                    out.append({"name": f"gpu_decode_tpot_ms_{kind}", "value": x[f"tpot_ms_{kind}"],
                                "unit": "ms", "config": cfg, "device": summary.get("device"),
                                "jax": summary.get("jax"),
                                "date": datetime.date.today().isoformat(), "command": command})
    return out


def profile_records(label: str, summary: dict, meta: dict, command: str) -> list[dict]:
    d, c = summary.get("device-only"), summary.get("config", {})
    if not (isinstance(d, dict) and "busy_us_per_step" in d):
        return []
    cfg = {"run": label, **{k: c[k] for k in ("model", "backend", "batch", "ctx", "steps",
                                              "synthetic") if k in c},
           "patches": summary.get("patches", {}), **meta,
           "wall_ms_per_step": d["wall_ms_per_step"], "span_us_per_step": d["span_us_per_step"],
           "classes_us_per_step": d["classes"], "top_kernels": d["kernels"][:20],
           **({"by_position_us_per_step": d["by_position"]} if d.get("by_position") else {})}
    return [{"name": "profile_decode_device_busy_us_per_step", "value": d["busy_us_per_step"],
             "unit": "us", "config": cfg, "device": summary.get("device"),
             "jax": summary.get("jax", JAX_ON_DEVICE), "date": datetime.date.today().isoformat(),
             "command": command}]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--command", required=True)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a config entry of every record (model, ctx, steps, session, call...)")
    ap.add_argument("runs", nargs="+", metavar="LABEL=SUMMARY")
    ns = ap.parse_args()
    meta = dict(kv.split("=", 1) for kv in ns.set)
    meta = {k: int(v) if v.isdigit() else v for k, v in meta.items()}
    recs = []
    for run in ns.runs:
        label, _, path = run.partition("=")
        try:
            summary = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise SystemExit(f"decode_records: {run}: {e}") from None
        got = (profile_records if "device-only" in summary else records)(
            label, summary, meta, ns.command)
        if not got:
            raise SystemExit(f"decode_records: {path}: no timed backend / batch in it")
        recs += got
    Path(ns.out).write_text(json.dumps(recs, indent=1) + "\n")
    print(f"{len(recs)} records -> {ns.out}")


if __name__ == "__main__":
    main()
