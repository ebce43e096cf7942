"""GPU check and timing of the Pallas threshold search (pallas_kernels/sampling) against the jnp
search of jaxinfer.sampling_filters, on random float32 logits [S, V].

    PYTHONPATH=. python3 benchmarks/kernels/bench_sampling_search.py --out $OUT
    PYTHONPATH=. python benchmarks/kernels/bench_sampling_search.py --cpu-smoke  # CPU, interpret

For each S of ``--batches`` (1 and 256), rows of V = 128256 N(0, 9) logits (the scale of
benchmarks/sampling_cost.py), in this order:

1. check: the kernel's k-th values (k in [65, 4096]: rows that take the full-vocabulary
   search) equal the jnp search's bit for bit, and a numpy sort's; its top-p cuts (top_p
   0.5-0.99, top-k off on odd rows) equal the jnp search's, a row where they differ being
   accepted only when top_p lies within 1e-5 of a prefix mass (float64 sort on the host:
   float32 rounding decides there), and keep a float64 sort's tokens on up to 32 rows. A
   failed check or a kernel that does not compile exits 1 before any timing;
2. timing (kernel_bench.time_fn: runs queued back to back, each ``calls`` searches with
   distinct k / top_p in one jit, a ``lax.map`` loop; per search): "kth" (top-k search) and
   "nucleus" (top-p search, top-k off), jnp (``sampling_filters.PIVOTS``), the kernel in its
   default mode and pivots (rows split into segments, a launch per pass, below
   ``SPLIT_ROWS`` rows; else one launch), the kernel in the other mode, then its ``--pivots``
   and ``--num-warps`` sweeps, and the split mode with ``--split-segments`` (a segment length
   changes the one-launch mode's sums too: ``threshold_search.SEGMENT`` is one constant for
   both), while ``--deadline-s`` allows. Step 1 checks both modes at S = 1.

A table with the speed-ups prints last; every number is a record in ``<out>/results.json``.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.kernels.kernel_bench import RunRecords, time_fn
from jaxinfer import sampling_filters as sf
from pallas_kernels.sampling import threshold_search as ts

T0 = time.time()
RECORDS = RunRecords("benchmarks/kernels/bench_sampling_search.py")
ROWS: list[tuple] = []
# The kernel's loop geometry (--cpu-smoke: short segments, so that rows split).
GEOMETRY = {"segment": ts.SEGMENT, "block": ts.BLOCK, "unroll": ts.UNROLL}


def log(*a) -> None:
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def make_rows(S: int, V: int, seed: int = 0):
    rng = np.random.default_rng(seed + S)
    x = rng.standard_normal((S, V), dtype=np.float32) * np.float32(3.0)
    k = rng.integers(65, min(4096, V) + 1, S).astype(np.int32)
    p = rng.choice([0.5, 0.8, 0.9, 0.95, 0.99], S).astype(np.float32)
    return x, k, p


def searches(impl: str, interpret: bool, pivots: int | None = None, num_warps: int = 4,
             split: bool | None = None):
    """(kth(x, top, k), nucleus(x, top, kth, k, top_p)) of one implementation."""
    if impl == "jnp":
        return sf.kth_largest, sf.nucleus_cut
    kw = {"pivots": pivots, "num_warps": num_warps, "split": split, "interpret": interpret,
          **GEOMETRY}
    return (functools.partial(ts.kth_largest, **kw), functools.partial(ts.nucleus_cut, **kw))


def prefix_gap(row: np.ndarray, k: int, p: float) -> tuple[float, float]:
    """(float64 sorted-prefix cut of top-k then top-p, distance of p to a prefix mass)."""
    srt = -np.sort(-row.astype(np.float64))[:k]
    q = np.exp(srt - srt[0])
    q /= q.sum()
    before = np.cumsum(q) - q
    n = max(int((before < p).sum()), 1)
    return float(srt[n - 1]), float(np.min(np.abs(before[1:] - p), initial=np.inf))


def split_default(S: int, V: int) -> bool:
    return S < ts.SPLIT_ROWS and V > GEOMETRY["segment"]


def check(S: int, V: int, interpret: bool, split: bool) -> bool:
    x, k, p = make_rows(S, V)
    xs, top, kk, pp = map(jnp.asarray, (x, x.max(-1), k, p))
    kth_j = np.asarray(jax.jit(sf.kth_largest)(xs, top, kk))
    kth_fn, nuc_fn = searches("pallas", interpret, split=split)
    kth_p = np.asarray(jax.jit(kth_fn)(xs, top, kk))
    want = -np.sort(-x, axis=-1)[np.arange(S), k - 1]
    kth_eq = int((kth_p == kth_j).sum())
    sort_eq = int((kth_j == want).sum())
    on = np.arange(S) % 2 == 0  # top-k on even rows, off (k = V, kth = -inf) on odd ones
    k_n = jnp.asarray(np.where(on, k, V).astype(np.int32))
    kth_n = jnp.asarray(np.where(on, want, -np.inf).astype(np.float32))
    cut_j = np.asarray(jax.jit(sf.nucleus_cut)(xs, top, kth_n, k_n, pp))
    cut_p = np.asarray(jax.jit(nuc_fn)(xs, top, kth_n, k_n, pp))
    bad, tolerated = [], []
    k_host = np.asarray(k_n)
    for i in np.flatnonzero(cut_p != cut_j):
        _, gap = prefix_gap(x[i], int(k_host[i]), float(p[i]))
        (tolerated if gap < 1e-5 else bad).append(int(i))
    for i in range(min(S, 32)):  # both against a float64 sort
        cut64, gap = prefix_gap(x[i], int(k_host[i]), float(p[i]))
        if gap >= 1e-5 and not np.array_equal(x[i] >= cut_p[i], x[i] >= np.float32(cut64)):
            bad.append(int(i))
    ok = kth_eq == S and sort_eq == S and not bad
    log(f"check S={S} split={split}: kth equal {kth_eq}/{S} (jnp = sort {sort_eq}/{S}); "
        f"top-p cuts equal "
        f"{S - len(bad) - len(tolerated)}/{S}, within float32 rounding {tolerated}, "
        f"wrong {sorted(set(bad))} -> {'OK' if ok else 'FAILED'}")
    RECORDS.add(f"sampling_search_check_{'split' if split else 'row'}_s{S}", int(ok), "ok",
                {"S": S, "V": V, "split": split, "kth_equal": kth_eq, "jnp_equals_sort": sort_eq,
                 "cut_rows_tolerated": tolerated, "cut_rows_wrong": sorted(set(bad))})
    return ok


def time_case(S: int, V: int, fn: str, impl: str, args, pivots=None, num_warps=4,
              split=None, segment=None) -> None:
    x, k, p = make_rows(S, V)
    geometry = dict(GEOMETRY)
    if segment:
        GEOMETRY["segment"] = segment
    calls = 16 if S < 64 else 4  # one search traced (lax.map): each kernel compiled once
    xs, top = jnp.asarray(x), jnp.asarray(x.max(-1))
    kth_fn, nuc_fn = searches(impl, args.cpu_smoke, pivots, num_warps, split)
    if fn == "kth":
        ks = jnp.asarray(np.stack([np.minimum(k + 7 * i, V) for i in range(calls)]))
        run = jax.jit(lambda x, t, ks: jax.lax.map(lambda kv: kth_fn(x, t, kv), ks))
        a = (xs, top, ks)
    else:  # top-p alone: top-k off
        ps = jnp.asarray(np.stack([p - np.float32(0.01 * i) for i in range(calls)]))
        kth, kv = jnp.full((S,), -jnp.inf, jnp.float32), jnp.full((S,), V, jnp.int32)
        run = jax.jit(lambda x, t, ps: jax.lax.map(lambda pv: nuc_fn(x, t, kth, kv, pv), ps))
        a = (xs, top, ps)
    us = 1e6 * time_fn(run, [a], args.repeats) / calls
    split = split_default(S, V) if split is None else split
    P = sf.PIVOTS if impl == "jnp" else (pivots or ts.default_pivots(S, split))
    mode = "split" if split else "row"
    name = "jnp" if impl == "jnp" else f"pallas_{mode}_p{P}_w{num_warps}"
    name += f"_seg{segment}" if segment else ""
    ROWS.append((S, fn, name, us))
    log(f"S={S:4d} {fn:8s} {name:16s} {us:9.1f} us")
    RECORDS.add(f"sampling_search_{fn}_{name}_s{S}", us, "us",
                {"S": S, "V": V, "fn": fn, "impl": impl, "pivots": P,
                 "num_warps": num_warps if impl != "jnp" else None,
                 "mode": None if impl == "jnp" else mode, **GEOMETRY, "calls_per_run": calls,
                 "repeats": args.repeats})
    GEOMETRY.update(geometry)


def main() -> int:
    global T0
    T0 = time.time()  # deadlines and log stamps count from this run, not the import
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", ""))
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 256])
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--pivots", default="3,7,15", help="kernel sweep: thresholds per pass")
    ap.add_argument("--num-warps", default="4,8", help="kernel sweep (default pivots)")
    ap.add_argument("--split-segments", default="8192",
                    help="split-mode sweep below 64 rows: segment lengths (elements)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--deadline-s", type=float, default=90.0, help="no new case after this")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="V 2048, S 1 and 4, segments of 512, interpret")
    args = ap.parse_args()
    if args.cpu_smoke:
        args.vocab, args.batches, args.repeats, args.pivots, args.num_warps = (
            2048, [1, 4], 1, "3", "4")
        GEOMETRY.update(segment=512, block=128, unroll=2)
        args.split_segments = "256"
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        RECORDS.out_dir = args.out
    sf.SEARCH_IMPL = "jnp"  # sf.* is the jnp reference here; the kernel is called directly
    log("devices", jax.devices(), "jax", jax.__version__, "vocab", args.vocab)
    interpret = args.cpu_smoke
    V = args.vocab
    for S in args.batches:  # the default mode; at S = 1 both
        for split in dict.fromkeys([split_default(S, V), False]):
            try:
                if not check(S, V, interpret, split):
                    return 1
            except Exception:  # noqa: BLE001 - a kernel that does not lower / compile / run
                traceback.print_exc()
                log(f"check S={S} split={split}: the kernel raised (above)")
                return 1
    fns = ("kth", "nucleus")
    cases = [(S, fn, "jnp", None, 4, None, None) for S in args.batches for fn in fns]
    cases += [(S, fn, "pallas", None, 4, None, None) for S in args.batches for fn in fns]
    cases += [(S, fn, "pallas", None, 4, not split_default(S, V), None) for S in args.batches
              for fn in fns if V > GEOMETRY["segment"]]
    for S in args.batches:
        d = ts.default_pivots(S, split_default(S, V))
        cases += [(S, fn, "pallas", P, 4, None, None) for P in map(int, args.pivots.split(","))
                  if P != d for fn in ("nucleus", "kth")]
        cases += [(S, "nucleus", "pallas", None, w, None, None)
                  for w in map(int, args.num_warps.split(",")) if w != 4]
        cases += [(S, fn, "pallas", None, 4, True, seg) for seg in
                  map(int, filter(None, args.split_segments.split(",")))
                  if split_default(S, V) and seg != GEOMETRY["segment"] for fn in fns]
    for S, fn, impl, P, w, split, seg in cases:
        what = f"S={S} {fn} {impl} pivots={P} warps={w} split={split} segment={seg}"
        if time.time() - T0 > args.deadline_s:
            log(f"deadline: skipped {what}")
            continue
        try:
            time_case(S, V, fn, impl, args, P, w, split, seg)
        except Exception:  # noqa: BLE001 - keep timing the other cases
            traceback.print_exc()
            log(f"{what}: raised (above)")
    base = {(S, fn): us for S, fn, name, us in ROWS if name == "jnp"}
    print("\n| S | search | impl | us per search | vs jnp |\n|---:|---|---|---:|---:|")
    for S, fn, name, us in ROWS:
        ref = base.get((S, fn))
        print(f"| {S} | {fn} | {name} | {us:,.1f} | {'-' if not ref else f'{ref / us:.2f}x'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
