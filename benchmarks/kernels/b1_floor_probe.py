"""How much of a batch-1 paged decode call is fixed cost: kernels that only read (H200).

Issue #3 asks for 2x JAX's stock kernel at B = 1, ctx <= 4096, i.e. ~4.5 / 6.2 / 9.0 us a call
(CUPTI) at ctx 1024 / 2048 / 4096, where ours takes 5.2 / 7.8 / 10.1 (session 18). These
probes launch the same grid as ours (batch, KV head, split; 64-token steps, straight-line)
and drop the attention, to split the call into launch, reads and the rest:

  none    no K / V reads (the q rows copied by split 0): launch, ramp, tail of the grid
  direct  K / V read from pages at fixed addresses (no block table), summed
  bt      the page ids from the block table first (read before seq_lens arrives: ours now)
  len_bt  the block-table read masked by the split's end, which needs seq_lens first (the
          loop's dependent chain: length -> table -> K / V)
  bt_merge  bt, then ours' in-kernel split merge (decode_merge.merged_call: f32 partials
          [G, D] = the column sums, log2-sum-exp 0, barrier, arrival atomic, the last split
          merges): all of ours but the attention arithmetic

each beside ours (the default; ``unroll=0``; the merge's partial loads after its reductions,
``decode_merge.MERGE_PRELOAD_CHUNKS = 0``) and stock in the same process, on the
chained harness of bench_paged_attention.py (dependent calls over rotating layers). Every
probe writes its f32 column sums (so no read is dead) and copies q (the chain's
dependency); ``--cpu-smoke`` checks the sums against numpy in interpret mode.

    PYTHONPATH=. python3 benchmarks/kernels/b1_floor_probe.py --out $OUT/b1_floor
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
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from benchmarks.kernels import bench_paged_attention as bpa
from benchmarks.kernels.bench_paged_small_batch import Cupti
from benchmarks.kernels.kernel_bench import RunRecords, time_fn
from pallas_kernels.paged_attention import decode_merge
from pallas_kernels.paged_attention.decode_options import split_grid

warnings.filterwarnings("ignore")
MODES = ("none", "direct", "bt", "len_bt", "bt_merge")
T0 = time.time()


def log(*a) -> None:
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def _probe_kernel(layer_ref, bt_ref, len_ref, q_ref, k_ref, v_ref, o_ref, sum_ref, *,
                  mode: str, ps: int, bp: int, pps: int, G: int, Gp: int, D: int) -> None:
    """o_ref / sum_ref: q copy [B, Hq, D] and column sums [B, Hkv, S, D]; with mode
    "bt_merge" (under merged_call) the partials [B, Hkv, S, G, D] and lse [B, Hkv, S, G]."""
    b, h, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    layer, seq_len, W = layer_ref[0], len_ref[b], bt_ref.shape[1]
    t = jnp.arange(bp * ps, dtype=jnp.int32)
    t_page, t_off = t // ps, t % ps
    col = jnp.arange(D, dtype=jnp.int32)
    total = jnp.zeros((D,), jnp.float32)  # column sums (no scalar reduction)
    end = jnp.minimum((s + 1) * pps, (seq_len + ps - 1) // ps)
    for i in range(pps // bp if mode != "none" else 0):
        slot = s * pps + i * bp + t_page
        valid = (slot < W) & (slot * ps + t_off < seq_len)
        if mode == "direct":  # page ids a fixed function of the slot: no table read
            page = 1 + b * W + jnp.minimum(slot, W - 1)
        else:
            page = plgpu.load(bt_ref.at[b, slot], mask=slot < (end if mode == "len_bt" else W),
                              other=0)
        idx = (layer, h, page[:, None], t_off[:, None], col[None, :])
        zero = jnp.zeros((), k_ref.dtype)
        k = plgpu.load(k_ref.at[idx], mask=valid[:, None], other=zero)
        v = plgpu.load(v_ref.at[idx], mask=valid[:, None], other=zero)
        total = total + (k.astype(jnp.float32) + v.astype(jnp.float32)).sum(axis=0)
    row = jnp.arange(Gp, dtype=jnp.int32)
    if mode == "bt_merge":  # every row of the split's partial = its column sums, lse 0
        plgpu.store(o_ref.at[b, h, s, row[:, None], col[None, :]],
                    jnp.zeros((Gp, D), jnp.float32) + total[None, :], mask=(row < G)[:, None])
        plgpu.store(sum_ref.at[b, h, s, row], jnp.zeros((Gp,), jnp.float32), mask=row < G)
        return
    plgpu.store(sum_ref.at[b, h, s, col], total)
    qrow = h * G + row
    mask = ((row < G) & (s == 0))[:, None]
    qv = plgpu.load(q_ref.at[b, qrow[:, None], col[None, :]], mask=mask,
                    other=jnp.zeros((), q_ref.dtype))
    plgpu.store(o_ref.at[b, qrow[:, None], col[None, :]], qv, mask=mask)


def probe(q, k_cache, v_cache, layer, block_tables, seq_lens, *, mode: str,
          block_tokens: int = 64, num_splits: int | None = None, num_warps: int = 4,
          interpret: bool = False):
    """One probe call: (q copied [B, Hq, D], per-program column sums [B, Hkv, S, D] f32);
    "bt_merge": (the merged column sums [B, Hq, D] in q.dtype, the counters [B, Hkv])."""
    B, Hq, D = q.shape
    _, Hkv, _, ps, _ = k_cache.shape
    G, bp, maxp = Hq // Hkv, max(1, block_tokens // ps), block_tables.shape[1]
    S, pps = split_grid(B, Hkv, maxp, bp, num_splits)
    kernel = functools.partial(_probe_kernel, mode=mode, ps=ps, bp=bp, pps=pps, G=G,
                               Gp=max(16, G), D=D)
    params = plgpu.CompilerParams(num_warps=num_warps, num_stages=1)
    operands = [jnp.asarray(layer, jnp.int32).reshape(1), block_tables, seq_lens, q, k_cache,
                v_cache]
    if mode == "bt_merge":
        return decode_merge.merged_call(kernel, operands, B=B, Hkv=Hkv, S=S, G=G, D=D,
                                        dtype=q.dtype, name="b1_probe_bt_merge",
                                        interpret=interpret, compiler_params=params,
                                        counters=None)
    return pl.pallas_call(
        kernel, grid=(B, Hkv, S), interpret=interpret, name=f"b1_probe_{mode}",
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                   jax.ShapeDtypeStruct((B, Hkv, S, D), jnp.float32)],
        compiler_params=params,
    )(*operands)


def expected_sums(c, mode: str, layer: int, block_tokens: int = 64) -> np.ndarray:
    """numpy: each program's sum of the K and V elements it reads ([B, Hkv, S])."""
    kc, vc = (np.asarray(x[layer], np.float64) for x in (c["kc"], c["vc"]))
    bt, lens = np.asarray(c["bt"]), np.asarray(c["lens"])
    B, W = bt.shape
    Hkv, ps = kc.shape[0], kc.shape[2]
    S, pps = split_grid(B, Hkv, W, max(1, block_tokens // ps))
    out = np.zeros((B, Hkv, S))
    for b in range(B):
        for s in range(S):
            for slot in range(s * pps, min((s + 1) * pps, W)):
                n = min(ps, max(0, lens[b] - slot * ps))
                if mode == "none" or n == 0:
                    continue
                page = 1 + b * W + slot if mode == "direct" else bt[b, slot]
                out[b, :, s] += (kc[:, page, :n] + vc[:, page, :n]).sum(axis=(1, 2))
    return out


def runner(c, mode: str, interpret: bool = False, **opts):
    """bench_paged_attention's chain of dependent calls over rotating layers, for a probe
    (``opts``: block_tokens / num_splits / num_warps)."""
    def step(q, i, kc, vc, bt, lens, *layers):
        return probe(q, kc, vc, layers[i], bt, lens, mode=mode, interpret=interpret,
                     **opts)[0]
    return bpa.layer_chain(c, step)


TOLERANCE = {"bt_merge": 2e-2}  # its merged output is bf16 (q.dtype); the others f32


def check(c, interpret: bool) -> dict[str, float]:
    """Each probe's error (max abs over the largest |sum|) against numpy (layer 1).

    Raises:
      AssertionError: a probe above its tolerance (1e-3, :data:`TOLERANCE`), a non-finite
        sum, or q not copied.
    """
    errs = {}
    for mode in MODES:
        q, sums = probe(c["q"], c["kc"], c["vc"], 1, c["bt"], c["lens"], mode=mode,
                        interpret=interpret)
        ref = expected_sums(c, mode, 1)
        if mode == "bt_merge":  # each q row: the mean over splits of the column sums
            B, Hkv = ref.shape[:2]
            ref = np.repeat(ref.mean(axis=2), q.shape[1] // Hkv, axis=1)
            got = np.asarray(q, np.float64).sum(axis=-1)
        else:
            got = np.asarray(sums, np.float64).sum(axis=-1)
            if not np.array_equal(np.asarray(q), np.asarray(c["q"])):
                raise AssertionError(f"probe {mode}: q not copied")
        err = float(np.max(np.abs(got - ref)) / max(1.0, float(np.max(np.abs(ref)))))
        if not np.all(np.isfinite(got)) or err > TOLERANCE.get(mode, 1e-3):
            raise AssertionError(f"probe {mode}: sums off by {err:.2e}")
        errs[mode] = err
    return errs


def time_chain(make, c, repeats: int, cupti) -> tuple[float, float, float, str]:
    """(wall us, CUPTI kernel us, kernels, kernel names) per call of the chained runner
    ``make()`` returns for case ``c`` (CUPTI figures nan without CUPTI)."""
    run, a = make()
    calls = bpa.calls_for(c)
    wall = time_fn(run, a, repeats) / calls * 1e6
    return (wall, *cupti(run, a[0], calls))


def _ints(v: str) -> list[int]:
    return [int(x) for x in v.split(",") if x]


def main(argv: list[str] | None = None) -> None:
    global T0
    T0 = time.time()  # deadlines and log stamps count from this run, not the import
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT", ""))
    p.add_argument("--ctx", default="1024,2048,4096,8192")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cpu-smoke", action="store_true", help="tiny heads, interpret mode")
    p.add_argument("--sweep-splits", type=_ints, default=[],
                   help="also time the 'bt' probe and ours at every combination of these "
                        "split counts, --sweep-warps and --sweep-block-tokens")
    p.add_argument("--sweep-warps", type=_ints, default=[4])
    p.add_argument("--sweep-block-tokens", type=_ints, default=[64])
    p.add_argument("--deadline-s", type=float, default=1e9,
                   help="no new timing starts past this many seconds (the table still prints)")
    args = p.parse_args(argv)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    records = RunRecords("benchmarks/kernels/b1_floor_probe.py", args.out or None,
                         "b1_floor_probe.json")
    smoke = args.cpu_smoke
    heads = {"Hq": 8, "Hkv": 2, "D": 64, "L": 2} if smoke else {}
    ctxs = _ints(args.ctx) if not smoke else [200]  # 13 pages, the last one ragged
    cupti = Cupti(not smoke)
    log("devices", jax.devices(), "jax", jax.__version__)
    rows = []
    for ctx in ctxs:
        maxp = -(-ctx // 16)
        c = bpa.make_case(1, maxp * 16, **heads)
        c["lens"] = jnp.full((1,), ctx, jnp.int32)  # ragged end when ctx is not a page multiple
        errs = check(c, smoke)
        log(f"ctx {ctx}: probe sums against numpy:",
            " ".join(f"{m} {e:.1e}" for m, e in errs.items()))
        interp = {"interpret": True} if smoke else {}
        impls = [(m, {}, lambda m=m: runner(c, m, smoke)) for m in MODES]
        impls += [("ours", {}, lambda: bpa.ours_runner(c, **interp)),
                  ("ours u0", {"unroll": 0}, lambda: bpa.ours_runner(c, unroll=0, **interp)),
                  ("ours pre0", {"MERGE_PRELOAD_CHUNKS": 0},
                   lambda: bpa.ours_runner(c, **interp))]
        if not smoke:
            impls.append(("stock", None, lambda: bpa.stock_runner(c)))
        for S in args.sweep_splits:
            for w in args.sweep_warps:
                for bt in args.sweep_block_tokens:
                    o = {"num_splits": S, "num_warps": w, "block_tokens": bt}
                    tag = f"S{S}w{w}b{bt}"
                    impls += [(f"bt {tag}", o, lambda o=o: runner(c, "bt", smoke, **o)),
                              (f"ours {tag}", o, lambda o=o: bpa.ours_runner(c, **interp, **o))]
        row = {}
        for label, opts, make in impls:
            if time.time() - T0 > args.deadline_s:
                log("deadline: skipping", ctx, label)
                continue
            preload = decode_merge.MERGE_PRELOAD_CHUNKS  # "ours pre0": traced without
            decode_merge.MERGE_PRELOAD_CHUNKS = (opts or {}).get("MERGE_PRELOAD_CHUNKS", preload)
            try:
                wall, k_us, k_n, names = time_chain(make, c, 1 if smoke else args.repeats,
                                                    cupti)
            finally:
                decode_merge.MERGE_PRELOAD_CHUNKS = preload
            row[label] = k_us if k_us == k_us else wall
            bp = max(1, (opts or {}).get("block_tokens", 64) // 16)
            S, pps = split_grid(1, c["Hkv"], maxp, bp, (opts or {}).get("num_splits"))
            records.add(f"b1_floor/{label.replace(' ', '_')}/B1_ctx{ctx}", row[label], "us",
                        {"B": 1, "ctx": ctx, "Hq": c["Hq"], "Hkv": c["Hkv"], "D": c["D"],
                         "page": 16, "impl": label, "options": str(opts), "splits": S,
                         "steps_per_split": pps // bp, "wall_us_per_call": wall,
                         "cupti_kernel_us_per_call": k_us, "kernels_per_call": k_n,
                         "kernel_names": names, "kv_bytes_per_call": c["kv_bytes_per_call"]})
            log(f"ctx {ctx:6d} {label:16s} S={S:3d} CUPTI {k_us:6.2f} us ({k_n:.2f} "
                f"kernels/call {names}) wall {wall:7.2f} us")
        rows.append((ctx, row))
    labels = [*MODES, "ours", "ours u0", "ours pre0", "stock"]
    print(f"\nB1 paged decode: CUPTI kernel us per call (wall if no CUPTI) on "
          f"{jax.devices()[0].device_kind}; 8B heads unless --cpu-smoke")
    print(f"{'ctx':>6} " + " ".join(f"{x:>8}" for x in labels) + "   stock/2")
    for ctx, row in rows:
        cells = " ".join(f"{row.get(x, float('nan')):8.2f}" for x in labels)
        print(f"{ctx:6d} {cells}   {row.get('stock', float('nan')) / 2:7.2f}")
    if args.sweep_splits:
        print("\nSweep (fastest first, CUPTI us): the 'bt' probe | ours")
        for ctx, row in rows:
            for kind in ("bt ", "ours "):
                got = sorted((v, k[len(kind):]) for k, v in row.items()
                             if k.startswith(kind) and k != "ours u0")
                print(f"{ctx:6d} {kind:5s}" + "  ".join(f"{k} {v:.2f}" for v, k in got[:8]))


if __name__ == "__main__":
    sys.exit(main())
