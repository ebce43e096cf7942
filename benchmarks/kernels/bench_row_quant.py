"""The decode GEMMs' input kernels on one GPU: ``row_quant.norm_quant_fp8`` (RMSNorm and / or
per-token FP8 quantization, one program a row) at the engine's sites and row counts, by
``num_warps``; and SwiGLU + the down input's quantization as XLA's SwiGLU fusion then the
kernel ("unfused", the engine's path above 16 rows) against ``swiglu=True`` (one kernel); and
the o / down GEMMs' split-K partials summed and added in front of the next norm-quant
(``residual=SplitKPartials``) against XLA's epilogue + add fusion then the kernel.

Why: the 8B FP8 decode step at 64 rows (profile_decode, session 22/23) spends 5.6 µs a layer
in the down input's quantization ([64, 14336]: 64 programs, 4 warps, ~1.8 MB) and ~2.3 µs
in XLA's SwiGLU fusion before it; the norm + quant of [64, 4096] rows takes 2.7 µs.

First every variant is checked on the device against the first kernel variant: bit-identical
where the row's absmax alone decides (quantization only, SwiGLU), within the float32
reduction order of the mean square where the norm runs (scales within 1e-6, an element at an
e4m3 rounding boundary one step away on < 0.1 %); the fused SwiGLU likewise against the
unfused pair. Then one jitted call runs the site ``--layers`` times on distinct inputs
(straight-line, as the unrolled layers do; the inputs together exceed the L2): µs a call of
kernel time by CUPTI (kernel_bench.Cupti; the wall clock of such a call is the host's
launches: session 23 call 3 read 10-27 µs a call for kernels the engine's profile times at
1.5-5.6), and GB/s of the bytes read and written. The table prints last; records
(``make_record``) go to ``--out/row_quant.json``.

    PYTHONPATH=. python3 benchmarks/kernels/bench_row_quant.py --out $OUT/rq
    PYTHONPATH=. python3 benchmarks/kernels/bench_row_quant.py --cpu-smoke
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.kernels.kernel_bench import Cupti, RunRecords, time_fn  # noqa: E402
from pallas_kernels.matmul.reference import silu_mul_ref  # noqa: E402
from pallas_kernels.matmul.row_quant import norm_quant_fp8  # noqa: E402
from pallas_kernels.matmul.triton_gemm import SplitKPartials  # noqa: E402

BF16, F32 = jnp.bfloat16, jnp.float32
# site name -> (input columns, norm, swiglu, split-K residual splits): Llama-3.1-8B's; the
# last is the gate/up (or QKV) site with the o (down) GEMM's 4 split-K partials added in front
# (transformer.FUSE_SPLITK_RESIDUAL; "unfused": XLA's epilogue + add fusion, then the kernel)
SITES = {"norm4096": (4096, True, False, 0), "quant4096": (4096, False, False, 0),
         "quant14336": (14336, False, False, 0), "swiglu14336": (28672, False, True, 0),
         "splitk4096": (4096, True, False, 4)}
INTERPRET = False  # --cpu-smoke: Pallas interpret mode


def site_fn(site: str, variant: str):
    """x [M, K] (and the norm weight) -> (q, scale) of the site, as ``variant`` computes it:
    "w<N>" norm_quant_fp8 with N warps, a pass per step; "w<N>s" the same reading the row
    once (one_pass); "unfused" (swiglu sites) XLA's silu_mul_ref then the kernel's plain
    quantization (4 warps, passes: the engine's default before this bench)."""
    K, norm, swiglu, splits = SITES[site]
    if splits:  # x is (x, SplitKPartials); (q, scale) of x + the partials' sum
        if variant == "unfused":
            return lambda xp, w: norm_quant_fp8(xp[0] + xp[1].reduce(), w, 1e-5,
                                                interpret=INTERPRET)
        warps, one = int(variant[1:].rstrip("s")), variant.endswith("s")
        return lambda xp, w: norm_quant_fp8(xp[0], w, 1e-5, residual=xp[1], num_warps=warps,
                                            one_pass=one, interpret=INTERPRET)[:2]
    if variant == "unfused":
        return lambda x, w: norm_quant_fp8(silu_mul_ref(x), num_warps=4, one_pass=False,
                                           interpret=INTERPRET)
    warps, one = int(variant[1:].rstrip("s")), variant.endswith("s")
    return lambda x, w: norm_quant_fp8(x, w if norm else None, 1e-5, swiglu=swiglu,
                                       num_warps=warps, one_pass=one, interpret=INTERPRET)


def make_run(site: str, variant: str, layers: int):
    f = site_fn(site, variant)

    @jax.jit
    def run(xs, w):
        return [f(xs[i], w) for i in range(layers)]
    return run


def inputs(site: str, M: int, layers: int, seed: int = 0):
    K, _, swiglu, splits = SITES[site]
    kx, kw, kp, ks = jax.random.split(jax.random.PRNGKey(seed), 4)
    xs = (jax.random.normal(kx, (layers, M, K), F32) * 2).astype(BF16)
    w = (jax.random.normal(kw, (K,), F32) * 0.1 + 1).astype(F32)
    xs = [xs[i] for i in range(layers)]
    if splits:  # the o / down GEMM's partials and epilogue scales, one set a layer
        ps = jax.random.normal(kp, (layers, splits, M, K), F32)
        xsc = jax.random.uniform(ks, (layers, M), F32, 0.01, 0.05)
        wsc = jax.random.uniform(ks, (K,), F32, 0.5, 2.0)
        xs = [(x, SplitKPartials(ps[i], xsc[i], wsc, BF16)) for i, x in enumerate(xs)]
    return xs, w[: K // 2 if swiglu else K]


def close(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    """(q, scale) pairs equal up to float32 rounding order: scales within 1e-6, q at most one
    e4m3 step apart on < 0.1 % of elements."""
    (q, s), (qr, sr) = a, b
    diff = q != qr
    return bool(np.allclose(s, sr, rtol=1e-6, atol=0) and diff.mean() < 1e-3
                and np.allclose(q[diff], qr[diff], rtol=2 ** -3))


def check(site: str, variants: list[str], M: int) -> dict:
    """Each kernel variant against the first (bit-identical, or :func:`close` where the norm
    runs) and, for SwiGLU and the split-K residual, the first kernel variant against the
    unfused pair (close)."""
    xs, w = inputs(site, M, 1, seed=1)
    outs = {v: [np.asarray(a.astype(F32)) for a in site_fn(site, v)(xs[0], w)]
            for v in variants}
    res = {}
    kernel_vs = [v for v in variants if v != "unfused"]
    base = outs[kernel_vs[0]]
    for v in kernel_vs[1:]:
        res[v] = (close(outs[v], base) if SITES[site][1]
                  else all(np.array_equal(a, b) for a, b in zip(outs[v], base)))
    if "unfused" in outs:
        res["fused_vs_unfused"] = close(base, outs["unfused"])
    return res


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ms", default="1,16,64,128")
    ap.add_argument("--sites", default=",".join(SITES))
    ap.add_argument("--variants", default="w4,w8,w16,w4s,w8s,w16s")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--deadline-s", type=float, default=150)
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="CPU, Pallas interpret mode, 2 rows, 2 layers: the script runs")
    ap.add_argument("--out", default=None)
    ns = ap.parse_args(argv)
    t0 = time.perf_counter()
    ms = [int(m) for m in ns.ms.split(",")]
    if ns.cpu_smoke:
        global INTERPRET
        INTERPRET = True
        jax.config.update("jax_platforms", "cpu")
        ms, ns.layers, ns.repeats = [2], 2, 1
    if ns.out:
        os.makedirs(ns.out, exist_ok=True)
    records = RunRecords("benchmarks/kernels/bench_row_quant.py", ns.out, "row_quant.json")
    cupti = Cupti(not ns.cpu_smoke)
    rows, failed = [], []
    for site in ns.sites.split(","):
        variants = ns.variants.split(",")
        if SITES[site][2] or SITES[site][3]:
            variants = ["unfused"] + variants
        for M in ms:
            if time.perf_counter() - t0 > ns.deadline_s:
                print(f"deadline: stopped before {site} M={M}", flush=True)
                break
            ok = check(site, variants, M)
            failed += [f"{site} M={M} {k}" for k, v in ok.items() if not v]
            K, _, swiglu, splits = SITES[site]
            # bf16 in, e4m3 out (+ float32 partials in, the bf16 sum out)
            moved = M * K * 2 + M * (K // 2 if swiglu else K) + 4 * M + splits * M * K * 4
            moved += M * K * 2 if splits else 0
            xs, w = inputs(site, M, ns.layers)
            for v in variants:
                run = make_run(site, v, ns.layers)
                wall = 1e6 * time_fn(run, [(xs, w)], ns.repeats) / ns.layers
                us, kernels, names = cupti(run, (xs, w), ns.layers)
                us = wall if np.isnan(us) else us  # no CUPTI (CPU smoke): the wall clock
                gbps = moved / us / 1e3
                rows.append((site, M, v, us, gbps))
                records.add(f"row_quant_{site}_us", us, "us",
                            {"site": site, "M": M, "K": K, "variant": v, "layers": ns.layers,
                             "GBps": gbps, "checks": ok, "wall_us": wall,
                             "kernels_a_call": kernels, "kernel_names": names,
                             "timing": "cupti" if cupti.enabled else "wall"})
                print(f"{site:12s} M={M:4d} {v:8s} {us:7.2f} us  {gbps:7.1f} GB/s "
                      f"(wall {wall:6.2f}, {kernels} kernels a call)", flush=True)
    names = ["unfused"] + ns.variants.split(",")
    print("\n µs a call\n site          M  " + "  ".join(f"{v:>7s}" for v in names))
    for site in SITES:
        for M in ms:
            got = {v: us for s, m, v, us, _ in rows if s == site and m == M}
            if got:
                print(f" {site:12s} {M:4d}  " + "  ".join(
                    f"{got[v]:7.2f}" if v in got else f"{'':7s}" for v in names))
    print("checks:", "all OK" if not failed else f"FAILED {failed}")
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
