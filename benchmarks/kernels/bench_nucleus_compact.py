"""The nucleus search kernel's bracket compaction (``threshold_search.COMPACT``) on the device:
check, then time its variants against the full passes.

    PYTHONPATH=. python3 benchmarks/kernels/bench_nucleus_compact.py --out $OUT
    PYTHONPATH=. python benchmarks/kernels/bench_nucleus_compact.py --cpu-smoke  # interpret

Rows [S, V] of N(0, s^2) logits (``--scales``: 3 / 0.8 is benchmarks/sampling_cost.py's
logits at its temperature 0.8; 1 a flat row, 8 a peaked one), top_p 0.9 (minus 0.01 per
call of a timed run), top-k off, the sampler's ``nucleus_floor`` as the bracket's start. The
reference is the kernel without compaction (``compact=0``: one launch at S >= 64, the split
mode below). Each variant (capacity x num_warps x block) must give the reference's cut on
every row except where top_p lies within 1e-5 of a prefix mass (float64 sort: float32
rounding decides there), else it is reported and not timed. Timing: ``kernel_bench.time_fn``
over a jitted ``lax.map`` of 4 (S >= 64) or 16 searches; per search in us, with the mean
passes over the row and elements copied. A table prints last; records in
``<out>/nucleus_compact.json``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.kernels.kernel_bench import RunRecords, time_fn  # noqa: E402
from jaxinfer import sampling_filters as sf  # noqa: E402
from pallas_kernels.sampling import threshold_search as ts  # noqa: E402


def rows(S: int, V: int, scale: float, seed: int):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((S, V)) * scale, jnp.float32)
    top, p = jnp.max(x, -1), jnp.full((S,), 0.9, jnp.float32)
    kth, k = jnp.full((S,), -jnp.inf, jnp.float32), jnp.full((S,), V, jnp.int32)
    return x, top, kth, k, p, sf.nucleus_floor(top, kth, k, p)


def near_prefix(x: np.ndarray, p: float) -> bool:
    """top_p within 1e-5 of a prefix mass of the row (float64 sort)."""
    q = np.sort(np.exp(x.astype(np.float64) - x.max()))[::-1]
    before = (np.cumsum(q) - q) / q.sum()
    return bool(np.min(np.abs(before[1:] - p)) < 1e-5)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", ""))
    ap.add_argument("--batches", type=int, nargs="+", default=[256, 1])
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--scales", type=float, nargs="+", default=[3 / 0.8, 1.0, 8.0])
    ap.add_argument("--compact", default="2048,4096,8192")
    ap.add_argument("--num-warps", default="4,8")
    ap.add_argument("--blocks", default="1024,512")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--deadline-s", type=float, default=100.0)
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="vocab 4096, batches 8 and 1, one scale, interpret mode")
    a = ap.parse_args()
    interpret = a.cpu_smoke or jax.default_backend() != "gpu"
    if a.cpu_smoke:
        a.vocab, a.batches, a.scales, a.repeats = 4096, [8, 1], a.scales[:1], 1
    recs = RunRecords("benchmarks/kernels/bench_nucleus_compact.py", a.out or None,
                      "nucleus_compact.json")
    variants = [dict(compact=c, num_warps=w, block=b) for c in map(int, a.compact.split(","))
                for w in map(int, a.num_warps.split(",")) for b in map(int, a.blocks.split(","))]
    t0, table = time.perf_counter(), []
    print(f"device {jax.devices()[0].device_kind}, vocab {a.vocab}", flush=True)
    for scale in a.scales:
        for S in a.batches:
            x, top, kth, k, p, lo = rows(S, a.vocab, scale, seed=S + int(10 * scale))
            calls = 4 if S >= 64 else 16
            ps = jnp.stack([p - np.float32(0.01 * i) for i in range(calls)])
            ref_kw = dict(compact=0, interpret=interpret)
            ref = np.asarray(ts.nucleus_cut(x, top, kth, k, p, lo=lo, **ref_kw))
            xs = np.asarray(x)
            for kw in [ref_kw] + [dict(v, interpret=interpret) for v in variants]:
                if time.perf_counter() - t0 > a.deadline_s:
                    print("deadline reached: remaining cases skipped", flush=True)
                    break
                name = ("full passes" if not kw["compact"] else
                        f"c{kw['compact']}/w{kw['num_warps']}/b{kw['block']}")
                try:
                    stats = None
                    if kw["compact"]:
                        cut, st = ts.nucleus_cut(x, top, kth, k, p, lo=lo, return_stats=True,
                                                 **kw)
                        cut, stats = np.asarray(cut), np.asarray(st)
                        diff = np.nonzero(cut != ref)[0]
                        bad = [int(i) for i in diff if not near_prefix(xs[i], 0.9)]
                        if bad:
                            print(f"S={S} s={scale:.2f} {name}: WRONG cut on rows {bad[:8]}")
                            table.append((S, scale, name, None, stats, len(bad)))
                            continue

                    def run(x, t, kth, k, lo, ps, kw=kw):
                        return jax.lax.map(lambda pv: ts.nucleus_cut(x, t, kth, k, pv, lo=lo,
                                                                     **kw), ps)
                    us = 1e6 * time_fn(jax.jit(run), [(x, top, kth, k, lo, ps)],
                                       a.repeats) / calls
                except Exception as e:  # noqa: BLE001 (a variant that fails is reported)
                    print(f"S={S} s={scale:.2f} {name}: {type(e).__name__}: {str(e)[:300]}")
                    continue
                passes = None if stats is None else float(stats[:, 0].mean())
                copied = None if stats is None else float(stats[stats[:, 1] >= 0, 1].mean())
                table.append((S, scale, name, us, stats, 0))
                print(f"S={S:4d} s={scale:5.2f} {name:18s} {us:9.1f} us"
                      + ("" if stats is None else f"  passes {passes:.2f} copied {copied:.0f}"),
                      flush=True)
                recs.add(f"nucleus_compact_s{S}_{name.replace('/', '_').replace(' ', '_')}",
                         us, "us", {"S": S, "V": a.vocab, "scale": scale, "top_p": 0.9,
                                    "calls_per_run": calls, "mean_passes_over_row": passes,
                                    "mean_elements_copied": copied, "interpret": interpret,
                                    **{k2: v for k2, v in kw.items() if k2 != "interpret"}})
    print("\n| S | logit std | variant | us per search | passes over the row | copied |")
    print("|---:|---:|---|---:|---:|---:|")
    for S, scale, name, us, stats, bad in table:
        tail = ("-", "-") if stats is None else (f"{stats[:, 0].mean():.2f}",
                                                 f"{stats[stats[:, 1] >= 0, 1].mean():.0f}")
        val = f"WRONG ({bad} rows)" if us is None else f"{us:,.1f}"
        print(f"| {S} | {scale:.2f} | {name} | {val} | {tail[0]} | {tail[1]} |")
    return 1 if any(r[3] is None for r in table) else 0


if __name__ == "__main__":
    sys.exit(main())
