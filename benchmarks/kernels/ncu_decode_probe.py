"""Hardware counters of the paged decode kernel, for Nsight Compute (``ncu``) on the H200.

Issue #3's FP8-KV miss (FP8 reads its bytes at ~0.8 of bf16's GB/s, NOTES_paged_attention
"Session 19") was so far placed only by timing variants and by static analysis of the SASS;
this launches the kernel at a few named cases, each a handful of times after a warm-up, so
that ``ncu`` can read where the time goes (DRAM throughput against peak, issue-slot use, warp
stall reasons, occupancy). Every case's output is first checked against
``paged_decode_attention_ref`` (relative L2 < 2e-2), so the counters belong to a kernel that
computes the right thing.

    ncu --clock-control none --kernel-name regex:paged_decode --csv --page details \\
        --section SpeedOfLight --section WarpStateStats ... \\
        python3 benchmarks/kernels/ncu_decode_probe.py --cases bf16:64x2048,fp8:64x2048
    PYTHONPATH=. python3 benchmarks/kernels/ncu_decode_probe.py --cpu-smoke   # CPU, interpret

``scripts/ncu_decode.sh`` wraps the ncu call and ``--summarize`` turns its CSV into one table
(one row a kernel launch: name, duration, DRAM %, issue-active %, warps an SM, top stalls).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import sys

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.kernels import bench_paged_attention as bpa
from benchmarks.kernels.kernel_bench import rel_err
from pallas_kernels.paged_attention import paged_decode_attention, paged_decode_attention_ref

F8 = jnp.float8_e4m3fn
CHECK_LIMIT = 2e-2


def parse_cases(text: str) -> list[tuple[str, int, int, dict]]:
    """'bf16:64x2048,fp8:8x4096@kq8_bt64_w2' -> [(dtype, B, ctx, extra kwargs)]; ValueError
    naming the piece that does not parse."""
    out = []
    for tok in (t for t in text.split(",") if t):
        try:
            kind, rest = tok.split(":")
            shape, _, variant = rest.partition("@")
            B, ctx = (int(v) for v in shape.split("x"))
            if kind not in ("bf16", "fp8"):
                raise ValueError(kind)
        except ValueError as e:
            raise ValueError(f"--cases: cannot read {tok!r} (form bf16:BxCTX or "
                             f"fp8:BxCTX[@variant])") from e
        extra = {"fp8_variant": variant} if variant else {}
        out.append((kind, B, ctx, extra))
    return out


class ProfilerRange:
    """``cuProfilerStart`` / ``cuProfilerStop`` of the CUDA driver (libcuda.so.1, by ctypes)
    around the launches to profile, for ``ncu --profile-from-start off``: JAX's start-up,
    compiles and the checked warm-up run outside ncu's range. Disabled: does nothing.

    Raises:
      OSError: enabled where the CUDA driver library cannot be loaded.
    """

    def __init__(self, enabled: bool):
        self.lib = None
        if enabled:
            import ctypes
            self.lib = ctypes.CDLL("libcuda.so.1")

    def __enter__(self):
        if self.lib is not None:
            self.lib.cuProfilerStart()
        return self

    def __exit__(self, *exc):
        if self.lib is not None:
            self.lib.cuProfilerStop()
        return False


def run_case(kind: str, B: int, ctx: int, extra: dict, launches: int, heads: dict,
             interpret: bool, profiler: ProfilerRange | None = None) -> dict:
    """Checks one case against the reference, then launches it ``launches`` more times
    (inside ``profiler``'s range when given)."""
    c = bpa.make_case(B, ctx, kv_dtype=F8 if kind == "fp8" else jnp.bfloat16, L=2,
                      tiny=interpret, **heads)
    scale = 1.0 / math.sqrt(c["D"])
    args = (c["q"], c["kc"], c["vc"], jnp.int32(1), c["bt"], c["lens"])
    f = jax.jit(lambda *a: paged_decode_attention(*a, scale=scale, interpret=interpret,
                                                  **c["scales"], **extra))
    ref = jax.jit(lambda *a: paged_decode_attention_ref(*a, scale=scale, **c["scales"]))
    out = f(*args)
    err = rel_err(out, ref(*args))
    ok = bool(err < CHECK_LIMIT and np.isfinite(np.asarray(out, np.float32)).all())
    out.block_until_ready()
    with profiler or ProfilerRange(False):
        for _ in range(launches):
            out = f(*args)
        out.block_until_ready()
    return {"case": f"{kind}:{B}x{ctx}", **extra, "rel_err": err, "ok": ok,
            "kv_bytes": c["kv_bytes_per_call"]}


# The metrics the summary keeps (ncu's names in the details page), by column label.
SUMMARY_METRICS = {
    "us": "Duration",
    "dram%": "DRAM Throughput",
    "mem%": "Memory Throughput",
    "issue%": "Issue Slots Busy",
    "ipc": "Executed Ipc Active",
    "warps/SM": "Achieved Active Warps Per SM",
    "theo_warps": "Theoretical Active Warps per SM",
    "regs": "Registers Per Thread",
    "smem_KB": "Dynamic Shared Memory Per Block",
    "grid": "Grid Size",
    "cyc/issue": "Warp Cycles Per Issued Instruction",
}


# Stall reasons as requested by scripts/ncu_decode.sh (--metrics regex:...): warps stalled
# for a reason per issued instruction, averaged over the schedulers.
STALL_PREFIX = "smsp__average_warps_issue_stalled_"
STALL_SUFFIX = "_per_issue_active.ratio"


def summarize(csv_text: str) -> list[dict]:
    """Rows of ncu's ``--csv --page details`` output -> one dict a kernel launch with the
    :data:`SUMMARY_METRICS` (Duration in µs) and the three largest stall reasons
    (:data:`STALL_PREFIX` metrics), when present. ValueError if there is no CSV table."""
    start = csv_text.find('"ID"')
    if start < 0:
        raise ValueError("no ncu CSV table (a line starting with \"ID\") in the input")
    launches: dict[str, dict] = {}
    for row in csv.DictReader(io.StringIO(csv_text[start:])):
        key = row["ID"]
        d = launches.setdefault(key, {"id": int(key), "kernel": row["Kernel Name"][:48]})
        name, unit, value = row["Metric Name"], row.get("Metric Unit", ""), row["Metric Value"]
        try:
            v = float(value.replace(",", ""))
        except ValueError:
            continue
        for label, metric in SUMMARY_METRICS.items():
            if name == metric:
                if label == "us":
                    v *= {"nsecond": 1e-3, "ns": 1e-3, "msecond": 1e3, "ms": 1e3}.get(unit, 1)
                d[label] = v
        if name.startswith(STALL_PREFIX) and name.endswith(STALL_SUFFIX):
            d.setdefault("stalls", {})[name[len(STALL_PREFIX):-len(STALL_SUFFIX)]] = v
    rows = []
    for d in sorted(launches.values(), key=lambda d: d["id"]):
        st = d.pop("stalls", {})
        d["top_stalls"] = sorted(st.items(), key=lambda kv: -kv[1])[:3]
        rows.append(d)
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--cases", default="bf16:64x2048,fp8:64x2048")
    p.add_argument("--launches", type=int, default=2, help="launches after the checked one")
    p.add_argument("--heads", default="32/8/128", help="Hq/Hkv/D")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny heads, interpret mode")
    p.add_argument("--profiler-range", action="store_true",
                   help="cuProfilerStart/Stop around the launches (ncu --profile-from-start off)")
    p.add_argument("--summarize", metavar="CSV", help="print the table of an ncu CSV; exit")
    p.add_argument("--out", default="", help="JSON of the checks (and of --summarize)")
    args = p.parse_args(argv)
    if args.summarize:
        rows = summarize(open(args.summarize).read())
        cols = ["id", "kernel", *SUMMARY_METRICS]
        print(" | ".join(cols) + " | top stalls")
        for r in rows:
            cells = [f"{r[k]:.4g}" if isinstance(r.get(k), float) else str(r.get(k, "-"))
                     for k in cols]
            print(" | ".join(cells) + " | " + "; ".join(f"{n} {v:.3g}"
                                                        for n, v in r["top_stalls"]))
        if args.out:
            json.dump(rows, open(args.out, "w"), indent=1)
        return
    heads = {"Hq": 8, "Hkv": 2, "D": 64} if args.cpu_smoke else bpa.parse_heads(args.heads)
    cases = parse_cases(args.cases)
    if args.cpu_smoke:
        cases = [(k, 2, 256, e) for k, _, _, e in cases]
    profiler = ProfilerRange(args.profiler_range)
    res = [run_case(*cs, launches=args.launches, heads=heads, interpret=args.cpu_smoke,
                    profiler=profiler) for cs in cases]
    for r in res:
        print(json.dumps(r), flush=True)
    if args.out:
        json.dump(res, open(args.out, "w"), indent=1)
    if not all(r["ok"] for r in res):
        sys.exit(1)


if __name__ == "__main__":
    main()
