"""Would a split merge through distributed shared memory reach 2x stock at batch 1? (H200)

Session 18's probes (b1_floor_probe.py, NOTES_paged_attention "Where a batch-1 call goes")
found that ours' in-kernel split merge through global memory (f32 partials, barrier, arrival
atomic, the last split's loads) costs 1.5-2.0 us of a B1 call, and that reads plus that merge
with no attention arithmetic already exceed 2x stock's time at ctx <= 4096. The one design
left is a merge inside a thread-block cluster: the splits of one (sequence, KV head) run as
the CTAs of a cluster, each leaves its partial in its own shared memory, and after a cluster
barrier one CTA reads the others' partials through distributed shared memory (Hopper's
``ld.shared::cluster``) -- no global round trip. Pallas reaches clusters only through Mosaic
GPU (``plgpu.kernel(cluster=...)``, ``plgpu.cluster_ref``, ``plgpu.ClusterBarrier``).

These probes read the KV of a B1 call through the block table with TMA (whole pages, one
barrier, no attention arithmetic: each CTA sums its pages' K + V into an f32 [page, D] tile,
as b1_floor_probe.py's probes sum columns) on a grid (batch, KV head, split groups) x a
cluster of C splits:

  mg_read     every CTA writes its partial tile to global memory (the cluster launched,
              nothing exchanged): launch + TMA reads
  mg_cluster  CTA 0 of each cluster adds the C partials through distributed shared memory
              after a cluster barrier and writes one tile; a second cluster barrier keeps
              the other CTAs (and their shared memory) alive until it has read them

The difference is the cluster merge's cost, to set beside the global merge's 1.5-2.0 us.
Both copy q's rows through shared memory (the chained harness's dependency, as the Triton
probes copy q). Splits: all pages of a split are in flight at once (at most ``MAX_PAGES``
pages a CTA: 16 x 2 x 4 KB), so S = max(C, pages / 16) rounded to a multiple of C; when S > C
a second level (across clusters) would still be needed -- the probe writes each cluster's sum.

Memory ordering: the cluster barrier is Mosaic GPU's (``mbarrier.arrive`` on every CTA of the
cluster through ``mapa``); Hopper orders a CTA's shared-memory stores before its arrive at
CTA scope, which suffices here in practice but not by the PTX memory model's letter (a
production kernel would fence at cluster scope). The sums are checked against numpy first.

    PYTHONPATH=. python3 benchmarks/kernels/b1_cluster_probe.py --out $OUT/b1_cluster
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from benchmarks.kernels import b1_floor_probe as fp
from benchmarks.kernels import bench_paged_attention as bpa
from benchmarks.kernels.bench_paged_small_batch import Cupti
from benchmarks.kernels.kernel_bench import RunRecords

warnings.filterwarnings("ignore")
MODES = ("mg_read", "mg_cluster")
MAX_PAGES = 16  # pages a CTA holds at once (K and V: 2 x 16 x 4 KB at D 128, bf16)
T0 = time.time()


def log(*a) -> None:
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def grid_of(maxp: int, C: int) -> tuple[int, int]:
    """(splits S, pages a split) for a ``maxp``-page table and clusters of C splits: S a
    multiple of C dividing the table, at most :data:`MAX_PAGES` pages a split.

    Raises:
      ValueError: no such S (the table is not C x a power-of-two pages).
    """
    S = C
    while maxp % S == 0 and maxp // S > MAX_PAGES:
        S *= 2
    if maxp % S or maxp // S > MAX_PAGES:
        raise ValueError(f"b1_cluster_probe: {maxp} pages do not split into a multiple of "
                         f"{C} splits of <= {MAX_PAGES} pages")
    return S, maxp // S


def _body(layer_ref, bt_ref, q_ref, k_ref, v_ref, qo_ref, sum_ref, k_smem, v_smem, part,
          q_smem, bar, q_bar, c_bar, done_bar, *, C: int, pps: int, G: int, merge: bool):
    b, h, sc, c = (lax.axis_index(n) for n in ("b", "h", "sc", "c"))
    s = sc * C + c
    layer = layer_ref[0]

    @pl.when(c == 0)
    def _():
        plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(h * G, G)], q_smem, q_bar)
    for j in range(pps):  # every page of the split in flight at once
        page = bt_ref[b, s * pps + j]
        plgpu.copy_gmem_to_smem(k_ref.at[layer, h, page], k_smem.at[j], bar)
        plgpu.copy_gmem_to_smem(v_ref.at[layer, h, page], v_smem.at[j], bar)
    plgpu.barrier_wait(bar)
    layout = plgpu.Layout.WG_STRIDED(part.shape, vec_size=4)
    acc = None
    for j in range(pps):
        kv = (plgpu.load(k_smem.at[j], layout=layout, optimized=False).astype(jnp.float32)
              + plgpu.load(v_smem.at[j], layout=layout, optimized=False)
              .astype(jnp.float32))
        acc = kv if acc is None else acc + kv
    part[...] = acc
    plgpu.commit_smem()
    if merge:
        plgpu.barrier_arrive(c_bar)  # every CTA of the cluster: my partial is written
        plgpu.barrier_wait(c_bar)

        @pl.when(c == 0)
        def _():
            tot = None
            for i in range(C):
                t = plgpu.load(plgpu.cluster_ref(part, {"c": i}), layout=layout,
                               optimized=False)
                tot = t if tot is None else tot + t
            part[...] = tot
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(part, sum_ref.at[b, h, sc])
            plgpu.wait_smem_to_gmem(0)
    else:
        plgpu.copy_smem_to_gmem(part, sum_ref.at[b, h, s])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(c == 0)
    def _():
        plgpu.barrier_wait(q_bar)
        plgpu.copy_smem_to_gmem(q_smem, qo_ref.at[b, pl.ds(h * G, G)])
        plgpu.wait_smem_to_gmem(0)
    if merge:  # the others wait until CTA 0 has read their shared memory
        plgpu.barrier_arrive(done_bar)
        plgpu.barrier_wait(done_bar)


def cluster_probe(q, k_cache, v_cache, layer, block_tables, *, mode: str, C: int = 8,
                  interpret: bool = False):
    """One probe call: (q copied [B, Hq, D], sums [B, Hkv, S or S / C, ps, D] f32): each
    split's (mg_read) or each cluster's (mg_cluster) sum of its pages' K + V tiles.

    Raises:
      ValueError: an unknown mode, or a table :func:`grid_of` cannot split.
    """
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}: one of {MODES}")
    B, Hq, D = q.shape
    _, Hkv, _, ps, _ = k_cache.shape
    G, maxp = Hq // Hkv, block_tables.shape[1]
    S, pps = grid_of(maxp, C)
    merge = mode == "mg_cluster"
    body = functools.partial(_body, C=C, pps=pps, G=G, merge=merge)
    params: dict = {"compiler_params": plgpu.CompilerParams()}
    if interpret:
        params = {"interpret": plgpu.InterpretGPUParams()}
    return plgpu.kernel(
        body,
        out_type=(jax.ShapeDtypeStruct(q.shape, q.dtype),
                  jax.ShapeDtypeStruct((B, Hkv, S // C if merge else S, ps, D), jnp.float32)),
        scratch_types=(plgpu.SMEM((pps, ps, D), k_cache.dtype),
                       plgpu.SMEM((pps, ps, D), v_cache.dtype),
                       plgpu.SMEM((ps, D), jnp.float32),
                       plgpu.SMEM((G, D), q.dtype),
                       plgpu.Barrier(num_arrivals=2 * pps),
                       plgpu.Barrier(),
                       plgpu.ClusterBarrier(collective_axes=("c",)),
                       plgpu.ClusterBarrier(collective_axes=("c",))),
        grid=(B, Hkv, S // C), grid_names=("b", "h", "sc"), cluster=(C,), cluster_names=("c",),
        **params,
    )(jnp.asarray(layer, jnp.int32).reshape(1), block_tables, q, k_cache, v_cache)


def expected(c, mode: str, layer: int, C: int) -> np.ndarray:
    """numpy: the sums :func:`cluster_probe` writes (every page of the table valid)."""
    kc, vc = (np.asarray(x[layer], np.float64) for x in (c["kc"], c["vc"]))
    bt = np.asarray(c["bt"])
    S, pps = grid_of(bt.shape[1], C)
    per = (kc[:, bt] + vc[:, bt])  # [Hkv, B, maxp, ps, D]
    per = per.reshape(per.shape[0], bt.shape[0], S, pps, *per.shape[3:]).sum(axis=3)
    per = per.transpose(1, 0, 2, 3, 4)  # [B, Hkv, S, ps, D]
    if mode == "mg_cluster":
        per = per.reshape(*per.shape[:2], S // C, C, *per.shape[3:]).sum(axis=3)
    return per


def check(c, C: int, interpret: bool) -> dict[str, float]:
    """Each probe's error (max abs over the largest |sum|) against numpy at layer 1 (in
    interpret mode mg_read only: JAX 0.11.2's Mosaic GPU interpreter has no ``cluster_ref``).

    Raises:
      AssertionError: a sum off by more than 1e-3 of the largest, a non-finite sum, or q not
        copied.
    """
    errs = {}
    for mode in MODES[:1] if interpret else MODES:
        q, sums = cluster_probe(c["q"], c["kc"], c["vc"], 1, c["bt"], mode=mode, C=C,
                                interpret=interpret)
        ref = expected(c, mode, 1, C)
        got = np.asarray(sums, np.float64)
        err = float(np.max(np.abs(got - ref)) / max(1.0, float(np.max(np.abs(ref)))))
        if not np.all(np.isfinite(got)) or err > 1e-3:
            raise AssertionError(f"probe {mode} C{C}: sums off by {err:.2e}")
        if not np.array_equal(np.asarray(q), np.asarray(c["q"])):
            raise AssertionError(f"probe {mode} C{C}: q not copied")
        errs[mode] = err
    return errs


def runner(c, mode: str, C: int, interpret: bool = False):
    def step(q, i, kc, vc, bt, lens, *layers):
        return cluster_probe(q, kc, vc, layers[i], bt, mode=mode, C=C, interpret=interpret)[0]
    return bpa.layer_chain(c, step)


def main(argv: list[str] | None = None) -> None:
    global T0
    T0 = time.time()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT", ""))
    p.add_argument("--ctx", default="1024,2048,4096")
    p.add_argument("--clusters", default="8,16", help="cluster sizes (splits a cluster)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cpu-smoke", action="store_true", help="tiny heads, interpret mode")
    p.add_argument("--deadline-s", type=float, default=1e9)
    args = p.parse_args(argv)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    records = RunRecords("benchmarks/kernels/b1_cluster_probe.py", args.out or None,
                         "b1_cluster_probe.json")
    smoke = args.cpu_smoke
    heads = {"Hq": 8, "Hkv": 2, "D": 64, "L": 2} if smoke else {}
    ctxs = fp._ints(args.ctx) if not smoke else [256]
    sizes = fp._ints(args.clusters) if not smoke else [2]
    cupti = Cupti(not smoke)
    log("devices", jax.devices(), "jax", jax.__version__)
    rows = []
    for ctx in ctxs:
        c = bpa.make_case(1, ctx, **heads)
        impls = []
        for C in sizes:
            try:
                errs = check(c, C, smoke)
            except Exception as e:  # noqa: BLE001  a cluster size the device refuses
                log(f"ctx {ctx} C{C}: FAILED {type(e).__name__}: {str(e)[:300]}")
                continue
            log(f"ctx {ctx} C{C}: sums against numpy:",
                " ".join(f"{m} {e:.1e}" for m, e in errs.items()))
            impls += [(f"{m} C{C}", lambda m=m, C=C: runner(c, m, C, smoke)) for m in errs]
        if not smoke:
            impls += [(m, lambda m=m: fp.runner(c, m)) for m in ("bt", "bt_merge")]
            impls += [("ours", lambda: bpa.ours_runner(c)), ("stock", lambda: bpa.stock_runner(c))]
        row = {}
        for label, make in impls:
            if time.time() - T0 > args.deadline_s:
                log("deadline: skipping", ctx, label)
                continue
            try:
                wall, k_us, k_n, names = fp.time_chain(make, c, 1 if smoke else args.repeats,
                                                       cupti)
            except Exception as e:  # noqa: BLE001  one failing variant must not lose the run
                log(f"ctx {ctx} {label}: FAILED {type(e).__name__}: {str(e)[:300]}")
                continue
            row[label] = k_us if k_us == k_us else wall
            C = int(label.split("C")[-1]) if label.startswith("mg_") else None
            S = grid_of(c["bt"].shape[1], C)[0] if C else None
            records.add(f"b1_cluster/{label.replace(' ', '_')}/B1_ctx{ctx}", row[label], "us",
                        {"B": 1, "ctx": ctx, "Hq": c["Hq"], "Hkv": c["Hkv"], "D": c["D"],
                         "page": 16, "impl": label, "cluster": C, "splits": S,
                         "wall_us_per_call": wall, "cupti_kernel_us_per_call": k_us,
                         "kernels_per_call": k_n, "kernel_names": names,
                         "kv_bytes_per_call": c["kv_bytes_per_call"]})
            log(f"ctx {ctx:6d} {label:16s} S={S} CUPTI {k_us:6.2f} us ({k_n:.2f} kernels/call "
                f"{names}) wall {wall:7.2f} us")
        rows.append((ctx, row))
    labels = sorted({k for _, r in rows for k in r}, key=lambda k: (not k.startswith("mg"), k))
    print(f"\nB1: CUPTI kernel us per call (wall if no CUPTI) on {jax.devices()[0].device_kind}")
    print(f"{'ctx':>6} " + " ".join(f"{x:>14}" for x in labels) + "   stock/2")
    for ctx, row in rows:
        cells = " ".join(f"{row.get(x, float('nan')):14.2f}" for x in labels)
        print(f"{ctx:6d} {cells}   {row.get('stock', float('nan')) / 2:7.2f}")


if __name__ == "__main__":
    sys.exit(main())
