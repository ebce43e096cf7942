"""Small-batch paged decode on one GPU: the split merge in XLA vs in the kernel (one launch).

Issue #3's remaining miss: at B = 1 and short contexts a call is ~11-12 µs (our split-K kernel
plus the XLA merge fusion) over 4-17 MB of KV, so launches, not bytes, bound it. This script
compares, in one process, at the Llama-3.1-8B heads (Hq 32, Hkv 8, D 128, page 16):

- ``xla``: ``paged_decode_attention(merge="xla")`` (kernel + merge fusion; the default
  before session 9, now ``merge="auto"`` picks the kernel merge at B * Hkv <= 16);
- ``kfresh``: ``merge="kernel"`` with fresh zero counters per call (the plain API);
- ``kcarry Sn``: ``merge="kernel"`` with the counters carried from call to call
  (``merge_counters=``, as a scan over layers would), at ``n`` splits around
  ``choose_num_splits``' pick: exactly one launch per call;
- ``stock``: ``jax.experimental.pallas.ops.gpu.paged_attention`` (bf16 only).

First it checks ours on the device (both merges; ragged lengths incl. 1 and a page
boundary, and a sliding window): relative L2 error against ``paged_decode_attention_ref``,
all finite, and ``merge="kernel"`` bit-identical over repeated runs (its result does not
depend on which split arrives last, so any difference is a race). Timing is
bench_paged_attention.py's harness, imported (a jitted chain of dependent calls over rotating
layers of a stacked cache, runs queued back to back, wall / calls, median of repeats); each
timed chain's output is also compared with the ``xla`` chain's. CUPTI
(``jax.experimental.mosaic.gpu.profiler``) adds the summed kernel time per call and the
number of kernels per call. The table (GB/s of KV bytes, ratio to stock) prints last; every
number is a record (``jaxinfer.bench.records.make_record``) in
``--out/paged_small_batch.json``. Built for < 150 s on an H200 (``--deadline-s``: no new
timing starts past it; the table still prints).

    PYTHONPATH=. python3 benchmarks/kernels/bench_paged_small_batch.py --out $OUT/psb
    PYTHONPATH=. python3 benchmarks/kernels/bench_paged_small_batch.py --cpu-smoke  # CPU
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import time
import traceback
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import apply_patches
from benchmarks.kernels import bench_paged_attention as bpa
from benchmarks.kernels.kernel_bench import Cupti, RunRecords, rel_err, time_fn
from pallas_kernels.paged_attention import paged_decode_attention, paged_decode_attention_ref

warnings.filterwarnings("ignore")
T0 = time.time()
F8 = jnp.float8_e4m3fn
# in priority order (the deadline cuts the tail): the misses first
GRID = [(1, 1024), (1, 2048), (1, 4096), (8, 1024), (8, 4096), (1, 32768), (32, 2048)]
FP8_GRID = [(1, 2048), (8, 4096)]
SMOKE = {"grid": [(1, 256)], "fp8": [], "heads": {"Hq": 8, "Hkv": 2, "D": 64}}
CHECK_LIMIT = 2e-2


def log(*a) -> None:
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def splits_of(c, **tune) -> int:
    """Splits the kernel launches with at this case and options (its grid's last axis)."""
    jaxpr = jax.make_jaxpr(lambda *a: paged_decode_attention(
        *a, scale=1.0, **c["scales"], **tune))(c["q"], c["kc"], c["vc"], jnp.int32(0),
                                               c["bt"], c["lens"])
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            return int(eqn.params["grid_mapping"].grid[2])
    raise RuntimeError("no pallas_call")


TUNE_KEYS = {"w": "num_warps", "s": "num_stages", "bt": "block_tokens", "u": "unroll",
             "sp": "num_splits", "ws": "wave_slots"}


def parse_tunes(text: str) -> list[tuple[str, dict]]:
    """'w2,w8s3,bt32' -> [("w2", {"num_warps": 2}), ("w8s3", {...}), ...]; ValueError on an
    unknown key or a token that does not parse."""
    out = []
    for tok in (t for t in text.split(",") if t):
        parts = re.findall(r"([a-z]+)(\d+)", tok)
        if "".join(k + v for k, v in parts) != tok or any(k not in TUNE_KEYS for k, _ in parts):
            raise ValueError(f"--tunes: cannot read {tok!r} (keys {sorted(TUNE_KEYS)})")
        out.append((tok, {TUNE_KEYS[k]: int(v) for k, v in parts}))
    return out


def split_points(text: str) -> tuple[list, list]:
    """'1x1024,fp8:8x2048' -> ([(1, 1024)], [(8, 2048)]): (bf16 points, FP8 points)."""
    pts = [x for x in text.split(",") if x]
    pick = lambda pre: [tuple(int(v) for v in x[len(pre):].split("x")) for x in pts
                        if x.startswith(pre) and (pre or ":" not in x)]
    return pick(""), pick("fp8:")


def carried_runner(c, **tune):
    """bench_paged_attention's chain with (q, counters) as the carried value: merge='kernel',
    the counters of one call passed to the next (one launch per call)."""
    scale = 1.0 / math.sqrt(c["D"])

    def step(state, i, kc, vc, bt, lens, *layers):
        q, ctr = state
        return paged_decode_attention(q, kc, vc, layers[i], bt, lens, scale=scale,
                                      merge="kernel", merge_counters=ctr, **c["scales"],
                                      **tune)
    return bpa.layer_chain(c, step, (c["q"], jnp.zeros((c["B"], c["Hkv"]), jnp.int32)))


def check_point(c, records, interp: dict, window: int = 0, kernel_splits=()) -> dict:
    """Rel. L2 errors against the reference at ragged lengths (1, 3 pages, the full context;
    at B = 1 only the full context), both merges; merge='kernel' run 5 times must give the
    same bits."""
    scale = 1.0 / math.sqrt(c["D"])
    lens = np.random.default_rng(1).integers(1, c["ctx"] + 1, c["B"])
    lens[0], lens[-1] = 1, c["ctx"]
    if c["B"] > 2:
        lens[len(lens) // 2] = 3 * c["ps"]
    lens = jnp.asarray(lens, jnp.int32)
    a = (c["q"], c["kc"], c["vc"], jnp.int32(c["L"] - 1), c["bt"], lens)
    ref = jax.jit(lambda *x: paged_decode_attention_ref(*x, scale=scale, window=window,
                                                        **c["scales"]))(*a)
    res = {}
    modes = [("xla", {"merge": "xla"}), ("kernel", {"merge": "kernel"})]
    modes += [(f"kernel_S{s}", {"merge": "kernel", "num_splits": s}) for s in kernel_splits]
    for name, tune in modes:
        try:
            f = jax.jit(lambda *x, t=tune: paged_decode_attention(
                *x, scale=scale, window=window, **c["scales"], **interp, **t))
            out = f(*a)
            e = rel_err(out, ref)
            stable = True
            if tune["merge"] == "kernel":
                for _ in range(1 if interp else 4):
                    stable &= bool(np.array_equal(np.asarray(f(*a), np.float32),
                                                  np.asarray(out, np.float32)))
        except Exception as ex:  # noqa: BLE001  record and go on
            e, stable = float("nan"), False
            log("check FAILED", name, type(ex).__name__, str(ex)[:300])
        ok = e < CHECK_LIMIT and stable
        res[name] = ok
        shape = f"B{c['B']}_ctx{c['ctx']}" + ("_fp8" if c["kc"].dtype == F8 else "")
        records.add(f"paged_small_batch/check_rel_err/{name}/{shape}_w{window}", e, "rel_l2",
                    {"B": c["B"], "ctx": c["ctx"], "kv_dtype": str(c["kc"].dtype),
                     "window": window, "tune": str(tune), "bit_stable": stable, "ok": ok})
        log(f"check {shape} window={window} {name}: rel err {e:.2e} stable={stable} "
            f"{'OK' if ok else 'BAD'}")
    return res


def bench_point(c, records, args, cupti, interp: dict) -> dict:
    """Times every implementation at one shape; returns {label: (GB/s, cupti µs, splits)}."""
    fp8 = c["kc"].dtype == F8
    shape = f"B{c['B']}_ctx{c['ctx']}" + ("_fp8" if fp8 else "")
    s0 = splits_of(c, merge="kernel")
    n_blocks = c["bt"].shape[1]  # an upper bound; splits_of() gives the real count
    around = [s0, s0 // 2] if c["B"] == 1 else [s0, 2 * s0]
    if s0 == 1:
        around = [2]
    cand = []
    for s in around:
        if 2 <= s <= n_blocks:
            s_eff = splits_of(c, merge="kernel", num_splits=s)
            if s_eff > 1 and s_eff not in cand:
                cand.append(s_eff)
    extra = []  # --splits, as the counts the kernel launches with (no count timed twice)
    for s in args.splits:
        s_eff = splits_of(c, merge="kernel", num_splits=s) if 2 <= s <= n_blocks else 1
        if s_eff > 1 and s_eff not in cand + extra:
            extra.append(s_eff)
    cand += extra
    runs = [] if fp8 else [("stock", None)]
    runs += [("xla", {"merge": "xla"})]
    runs += [(f"xla S{s}", {"merge": "xla", "num_splits": s}) for s in extra]
    runs += [(f"kfresh S{s}", {"merge": "kernel", "num_splits": s}) for s in extra]
    if s0 > 1:
        runs += [("kfresh", {"merge": "kernel"})]
    runs += [(f"tune {name}", dict(t)) for name, t in args.tunes]
    runs += [(f"kcarry S{s}", {"num_splits": s}) for s in cand]
    out, ref_out = {}, None
    for label, tune in runs:
        if time.time() - T0 > args.deadline_s:
            log("deadline: skipping", shape, label)
            continue
        try:
            if label == "stock":
                run, a = bpa.stock_runner(c, interpret=bool(interp))
            elif label.startswith("kcarry"):
                run, a = carried_runner(c, **interp, **tune)
            else:
                run, a = bpa.ours_runner(c, **interp, **tune)
            calls = bpa.calls_for(c)
            t = time_fn(run, a, args.repeats) / calls
            k_us, k_n, names = cupti(run, a[0], calls)
            chain_err = None
            if label != "stock":
                o = run(*a[0])
                o = o[0] if isinstance(o, tuple) else o
                if label == "xla":
                    ref_out = o
                elif ref_out is not None:
                    chain_err = rel_err(o, ref_out)
        except Exception as ex:  # noqa: BLE001  one failing variant must not lose the run
            log(f"FAILED {shape} {label}: {type(ex).__name__}: {str(ex)[:300]}")
            continue
        gbs = c["kv_bytes_per_call"] / t / 1e9
        splits = None if label == "stock" else splits_of(c, **(tune or {}))
        out[label] = (gbs, k_us, splits)
        cfg = {"B": c["B"], "ctx": c["ctx"], "Hq": c["Hq"], "Hkv": c["Hkv"], "D": c["D"],
               "page": c["ps"], "kv_dtype": str(c["kc"].dtype), "impl": label,
               "tune": str(tune), "splits": splits, "time_us": t * 1e6,
               "cupti_kernel_us_per_call": k_us, "kernels_per_call": k_n,
               "kernel_names": names, "chain_rel_err_vs_xla": chain_err,
               "kv_bytes_per_call": c["kv_bytes_per_call"], "layers": c["L"],
               "calls_per_run": calls}
        records.add(f"paged_small_batch/{label.replace(' ', '_')}/{shape}", gbs, "GB/s", cfg)
        ce = f" chain err {chain_err:.1e}" if chain_err is not None else ""
        log(f"{shape:16s} {label:11s} S={splits} {t * 1e6:7.1f} us {gbs:7.0f} GB/s | "
            f"CUPTI {k_us:6.1f} us, {k_n:.2f} kernels/call {names}{ce}")
    return out


def main(argv: list[str] | None = None) -> None:
    global T0
    T0 = time.time()  # deadlines and log stamps count from this run, not the import
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", ""))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes, interpret mode")
    p.add_argument("--deadline-s", type=float, default=120.0,
                   help="no new timing starts past this many seconds (the table still prints)")
    p.add_argument("--no-cupti", action="store_true")
    p.add_argument("--points", default="",
                   help="subset to time, e.g. '1x1024,fp8:1x2048' (default: all)")
    p.add_argument("--checks", default="",
                   help="device checks at these points instead of the built-in ones (the "
                   "--points syntax), at the --heads shape, both merges")
    p.add_argument("--no-checks", action="store_true", help="skip the device checks")
    p.add_argument("--heads", default="", help="Hq/Hkv/D of the timed points (default the "
                   "8B's 32/8/128), e.g. 32/8/64 or 16/8/256 for the other head dims")
    p.add_argument("--splits", default="", type=lambda v: [int(x) for x in v.split(",") if x],
                   help="more split counts to time at every point, both merges, e.g. '4,5,8'")
    p.add_argument("--tunes", default="", type=parse_tunes,
                   help="launch options to time at the default split count and merge, e.g. "
                        "'w2,w8s3,bt32,sp64u1,ws264' (w = num_warps, s = num_stages, bt = "
                        "block_tokens, u = unroll, sp = num_splits, ws = wave_slots)")
    p.add_argument("--patch", action="append", default=[], metavar="MODULE.NAME=VALUE",
                   help="set a module constant first (an A/B across runs of a plan constant "
                        "with no option, e.g. pallas_kernels.paged_attention.decode_merge."
                        "MERGE_PRELOAD_CHUNKS=0); recorded in every record's config")
    args = p.parse_args(argv)
    patches = apply_patches(args.patch, "bench_paged_small_batch")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    records = RunRecords("benchmarks/kernels/bench_paged_small_batch.py", args.out or None,
                         "paged_small_batch.json")
    if patches:
        records.common_config["patches"] = patches
    smoke = args.cpu_smoke
    grid, fp8_grid = (SMOKE["grid"], SMOKE["fp8"]) if smoke else (GRID, FP8_GRID)
    heads = SMOKE["heads"] if smoke else {}
    if args.heads and not smoke:
        try:
            heads = bpa.parse_heads(args.heads)
        except ValueError as e:
            p.error(f"--heads: {e}")
        records.common_config["heads"] = heads
    if args.points:
        grid, fp8_grid = split_points(args.points)
    args.check_points = None
    if args.checks:
        bf16_checks, fp8_checks = split_points(args.checks)
        args.check_points = ([(bc, {}) for bc in bf16_checks]
                             + [(bc, {"kv": F8}) for bc in fp8_checks])
    if smoke:
        args.repeats = 1
    calls_for = bpa.calls_for
    if smoke:  # short chains (the interpreter is slow to compile), restored on return
        bpa.calls_for = lambda c: 2
    try:
        _run(args, records, smoke, grid, fp8_grid, heads)
    finally:
        bpa.calls_for = calls_for


def _run(args, records, smoke: bool, grid, fp8_grid, heads: dict) -> None:
    interp = {"interpret": True} if smoke else {}
    cupti = Cupti(not (smoke or args.no_cupti))
    log("devices", jax.devices(), "jax", jax.__version__)

    # 1. correctness on this device before any timing
    checks = [((1, 2048), {}), ((1, 4096), {"window": 1000}), ((8, 1024), {}),
              ((32, 2048), {"kernel_splits": (2,)}), ((1, 2048), {"kv": F8}),
              ((128, 1024), {}), ((8, 2048), {"kv": F8})]  # 4 stages; FP8 at 4 programs an SM
    if smoke:
        checks = [((2, 256), {"kv": F8, "window": 100, "kernel_splits": (2,)})]
    if args.check_points is not None:
        checks = args.check_points
    if args.no_checks:
        checks = []
    bad = []
    for (B, ctx), kw in checks:
        kw = dict(kw)
        c = bpa.make_case(B, ctx, kv_dtype=kw.pop("kv", jnp.bfloat16), L=2, tiny=smoke,
                          **heads)
        res = check_point(c, records, interp, **kw)
        bad += [f"B{B} ctx{ctx} {k}" for k, ok in res.items() if not ok]
        del c
    log("checks:", "all OK" if not bad else f"BAD: {bad}")

    # 2. timings, the points of the miss first
    rows = []
    for kv, pts in ((jnp.bfloat16, grid), (F8, fp8_grid)):
        for B, ctx in pts:
            if time.time() - T0 > args.deadline_s:
                log("deadline: skipping", B, ctx, jnp.dtype(kv).name)
                continue
            c = bpa.make_case(B, ctx, kv_dtype=kv, tiny=smoke, **heads)
            name = f"B{B} ctx{ctx}" + (" fp8" if kv == F8 else "")
            rows.append((name, bench_point(c, records, args, cupti, interp)))
            del c

    print(f"\nSmall-batch paged decode on {jax.devices()[0].device_kind} "
          f"(Hq{heads.get('Hq', 32)}/Hkv{heads.get('Hkv', 8)}/D{heads.get('D', 128)}/ps16): "
          "GB/s of KV bytes (CUPTI kernel us per call); x = over stock")
    print(f"{'shape':16s} {'stock':>12s} {'xla':>16s} {'kfresh':>16s} {'best kcarry':>20s} "
          f"{'xla/st':>6s} {'best/st':>7s}")

    def cell(v, w):
        if not v:
            return f"{'-':>{w}s}"
        k = f"({v[1]:.1f})" if v[1] == v[1] else ""
        return f"{v[0]:.0f}{k}".rjust(w)
    for name, r in rows:
        carry = {k: v for k, v in r.items() if k.startswith("kcarry")}
        best = max(carry, key=lambda k: carry[k][0]) if carry else None
        st = r.get("stock")
        mine = [v for k, v in r.items() if k != "stock"]
        top = max(mine, key=lambda v: v[0]) if mine else None
        x1 = f"{r['xla'][0] / st[0]:6.2f}" if st and r.get("xla") else f"{'-':>6s}"
        x2 = f"{top[0] / st[0]:7.2f}" if st and top else f"{'-':>7s}"
        bc = (f"{best.split()[1]}:" + cell(carry[best], 14).strip()).rjust(20) if best else \
            f"{'-':>20s}"
        print(f"{name:16s} {cell(st, 12)} {cell(r.get('xla'), 16)} "
              f"{cell(r.get('kfresh'), 16)} {bc} {x1} {x2}")
    print("\nEvery variant by CUPTI kernel us per call (fastest first; wall GB/s after the /):")
    for name, r in rows:
        mine = sorted(((v[1], k, v[0]) for k, v in r.items()), key=lambda x: (x[0] != x[0], x[0]))
        print(f"{name:16s} " + "  ".join(f"{k}: {us:.1f}/{g:.0f}" for us, k, g in mine))
    if bad:
        print("CHECKS FAILED:", ", ".join(bad))


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except Exception:
        traceback.print_exc()
        raise
