"""Fixed cost per GEMM call from a bench_matmul record (NOTES_matmul "Session 13").

Least squares ``t = a + bytes / bw`` through the best time of each shape at one token count,
separately for our FP8 kernels and XLA's bf16 GEMM; prints the fit, each shape's residual,
and the weight size from which one call averages ``--target`` TB/s; writes the fit as JSON
records (``--out``). Runs on the CPU over a stored record:

    .venv/bin/python benchmarks/kernels/fit_fixed_cost.py \\
        benchmarks/results/matmul_h200_s13call1_tiles-20261202.json --m 16 --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from jaxinfer.bench.records import make_record  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("record")
    ap.add_argument("--m", type=int, default=16, help="token count (M) to fit")
    ap.add_argument("--target", type=float, default=3.6, help="TB/s")
    ap.add_argument("--out", default="", help="directory for the JSON records")
    ns = ap.parse_args()
    best: dict[tuple[str, str], tuple[float, float]] = {}
    records = json.load(open(ns.record))
    for r in records:
        c = r["config"]
        if r["name"] != "matmul_time" or c["M"] != ns.m or c["variant"] == "warmup":
            continue
        kind = "bf16" if c["variant"].startswith("xla") else "fp8"
        mb = c["K"] * c["N"] * (2 if kind == "bf16" else 1) / 1e6
        key = (c["shape"], kind)
        best[key] = min(best.get(key, (np.inf, mb)), (r["value"], mb))
    recs = []
    for kind in ("fp8", "bf16"):
        pts = sorted((mb, t, s) for (s, k), (t, mb) in best.items() if k == kind)
        x, y = np.array([p[0] for p in pts]), np.array([p[1] for p in pts])
        (a, b), *_ = np.linalg.lstsq(np.vstack([np.ones_like(x), x]).T, y, rcond=None)
        need = a / (1 / ns.target - b)  # MB at which bytes / (a + b * bytes) = target
        print(f"{kind}: t = {a:.2f} us + MB / {1 / b:.2f} TB/s; {ns.target} TB/s from "
              f"{need:.0f} MB")
        for mb, t, s in pts:
            print(f"  {s:14s} {mb:7.1f} MB {t:6.1f} us (fit {a + b * mb:6.1f}) {mb / t:5.2f} TB/s")
        cfg = {"kind": kind, "M": ns.m, "source": os.path.basename(ns.record),
               "measured_on": records[0]["device"],
               "shapes": {s: [mb, t] for mb, t, s in pts}}
        recs += [make_record("gemm_fixed_cost_us", float(a), "us", cfg),
                 make_record("gemm_stream_TBps", float(1 / b), "TBps", cfg),
                 make_record("gemm_MB_for_target", float(need), "MB",
                             dict(cfg, target_TBps=ns.target))]
    if ns.out:
        os.makedirs(ns.out, exist_ok=True)
        with open(os.path.join(ns.out, "gemm_fixed_cost.json"), "w") as f:
            json.dump(recs, f, indent=1)


if __name__ == "__main__":
    main()
