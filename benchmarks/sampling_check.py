"""Correctness of the sampler candidates (issue #7) on the device, before they are timed.

    PYTHONPATH=. python3 benchmarks/sampling_check.py --out DIR [--vocab 128256] [--smoke]

Fresh random inputs (seed printed and recorded). Checks, each a line of the table printed
last and a record ``sampling_check`` (value: failed checks) under ``--out``:

1. select: ``sampling_topk.SELECT_METHOD`` "sort" against "topk" (the TopK stages) at
   B = 1 and 256: ``top_chunks(x, 64)`` buffers and ids, ``top_values(x, 20)`` ids and values
   and ``buffered_cutoffs`` (top_k 50, top_p 0.9) equal bit for bit; the top-20 ids equal a
   stable numpy argsort on 4 rows. Logits N(0, 3^2) rounded to 0.05 (ties). The full
   nucleus cut (the Pallas kernel on a GPU) is the same with ``NUCLEUS_FLOOR`` as without.
2. hash: ``sampling_noise.hash_uniform`` on the device equals a numpy re-implementation bit
   for bit (integer hash, exact float conversion).
3. distribution: the all-flags sampler program with ``DRAW_METHOD`` "threefry" (control) and
   "hash" (+ SELECT "sort", NUCLEUS_FLOOR) on 8192 copies of one row (sample indices
   0..8191), four mixes of 2048 rows (temperature; top_p 0.9; top_k 8 + top_p 0.9;
   min_p 0.05 + top_k 50 + top_p 0.9),
   against the exact filtered distribution of the row (numpy, float64): no excluded token,
   and a chi-square p-value > 1e-4 over the kept tokens (12 carry the row's mass, the rest
   of the vocabulary sits 20 below).
4. invariance: the same seeded row alone (S = 1) and at row 100 of 256 random neighbours
   gives the same token, chosen logprob and top-20 ids (hash, sort, floor; mixes top_p,
   top_k_top_p, all), 4 sample indices each.
5. compaction: the nucleus kernel finishing on a copy of its bracket
   (``threshold_search.COMPACT``) against the same kernel's full passes (``compact=0``) on
   [256, V] rows N(0, s^2), s in {1, 3, 8}, top_p in {0.5, 0.9, 0.99}, the sampler's floor:
   the same cut bit for bit except where top_p lies within float32 rounding of a prefix
   mass, the kept tokens of 8 rows equal a float64 numpy sort's, every row alone (S = 1) cuts
   as in the batch; the passes over the row and elements copied are reported.

Exit status 1 if a check failed (the timing script should still run: the lead reads both).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import record  # noqa: E402

P_MIN = 1e-4
MIXES = {"temperature": dict(temperature=0.8), "top_p": dict(temperature=0.8, top_p=0.9),
         "top_k_top_p": dict(temperature=0.8, top_k=8, top_p=0.9),
         "all": dict(temperature=0.8, min_p=0.05, top_k=50, top_p=0.9)}


def set_methods(draw: str, select: str, floor: bool = False) -> None:
    from jaxinfer import sampling
    from jaxinfer import sampling_filters as sf
    from jaxinfer import sampling_topk as topk

    sampling.DRAW_METHOD, topk.SELECT_METHOD, sf.NUCLEUS_FLOOR = draw, select, floor


def sampler():
    """A fresh jitted all-flags sample_rows (jit's trace cache does not see the switches)."""
    import jax

    from jaxinfer.sampling import SamplerNeeds, sample_rows

    return jax.jit(lambda lg, sp, c: sample_rows(lg, sp, c, SamplerNeeds()))


def check_select(rng, V: int) -> list[tuple[str, bool, str]]:
    import jax
    import jax.numpy as jnp

    from jaxinfer import sampling_filters as sf
    from jaxinfer import sampling_topk as topk

    out = []
    for B in (1, 256):
        x = np.round(rng.standard_normal((B, V)) * 3 / 0.05) * 0.05
        x = jnp.asarray(x, jnp.float32)
        k, p = jnp.full((B,), 50, jnp.int32), jnp.full((B,), 0.9, jnp.float32)
        got = {}
        for m in ("topk", "sort"):
            set_methods("threefry", m)
            f = jax.jit(lambda x, k, p: (topk.top_chunks(x, 64), topk.top_values(x, 20),
                                         sf.buffered_cutoffs(x, jnp.max(x, -1), k, p)))
            got[m] = jax.tree.map(np.asarray, f(x, k, p))
        same = all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(got["topk"]),
                                                        jax.tree.leaves(got["sort"])))
        rows = np.asarray(x)[:4]
        ref = np.argsort(-rows, axis=1, kind="stable")[:, :20]
        ok_ref = np.array_equal(got["sort"][1][1][:4], ref)
        out.append((f"select sort == topk stages, B={B}", same, ""))
        out.append((f"select top-20 ids == numpy stable argsort, B={B}", ok_ref, ""))
        kth = jnp.full((B,), -jnp.inf, jnp.float32)  # rows without top-k: k = V
        kv, pv = jnp.full((B,), V, jnp.int32), jnp.asarray(rng.choice([0.5, 0.9, 0.99], B),
                                                           jnp.float32)
        cuts = []
        for floor in (False, True):
            set_methods("threefry", "topk", floor)
            cuts.append(np.asarray(jax.jit(lambda x, t, kth, k, p: sf.nucleus_cut(
                x, t, kth, k, p))(x, jnp.max(x, -1), kth, kv, pv)))
        out.append((f"nucleus floor: same cut, B={B}", np.array_equal(*cuts),
                    f"impl {sf.search_impl()}"))
    return out


def _np_hash_uniform(words: np.ndarray, V: int) -> np.ndarray:
    def mix(x):
        x = x ^ (x >> np.uint32(16))
        x = x * np.uint32(0x7FEB352D)
        x = x ^ (x >> np.uint32(15))
        x = x * np.uint32(0x846CA68B)
        return x ^ (x >> np.uint32(16))

    ids = np.arange(V, dtype=np.uint32)[None, :]
    with np.errstate(over="ignore"):
        h = mix(ids * np.uint32(0x9E3779B9) + words[:, :1])
        h = mix(h ^ words[:, 1:2])
    return ((h >> np.uint32(9)).astype(np.float32) + np.float32(0.5)) * np.float32(2.0 ** -23)


def check_hash(rng, V: int) -> list[tuple[str, bool, str]]:
    import jax.numpy as jnp

    from jaxinfer.sampling_noise import hash_uniform

    words = rng.integers(0, 2 ** 32, (4, 2), dtype=np.uint32)
    dev = np.asarray(hash_uniform(jnp.asarray(words), V))
    return [("hash uniforms == numpy, bit for bit", np.array_equal(dev, _np_hash_uniform(
        words, V)), f"min {dev.min():.3g} max {dev.max():.9f}")]


def filtered(row: np.ndarray, temperature: float, top_k: int = 0, top_p: float = 1.0,
             min_p: float = 0.0) -> np.ndarray:
    """The exact filtered distribution (vLLM order: temperature, min-p, top-k, top-p)."""
    x = row.astype(np.float64) / temperature
    q = np.exp(x - x.max())
    q = np.where(q >= min_p, q, 0.0)
    order = np.argsort(-x, kind="stable")
    if 0 < top_k < len(x):
        q[order[top_k:]] = 0.0
    q /= q.sum()
    if top_p < 1.0:
        sq = q[order]
        keep = np.cumsum(sq) - sq < top_p
        q[order[~keep]] = 0.0
        q /= q.sum()
    return q


def check_distribution(rng, V: int, n: int) -> list[tuple[str, bool, str]]:
    import jax.numpy as jnp
    from scipy import stats

    from jaxinfer.batch import SamplingArrays

    row = np.full(V, -20.0, np.float32)
    hot = rng.choice(V, 12, replace=False)
    row[hot] = np.log(np.linspace(1.0, 4.0, 12)) * 2.5
    S = n * len(MIXES)
    sa = SamplingArrays.neutral(S)
    sa.seeds[:] = rng.integers(0, 2 ** 31, 2)
    sa.sample_index[:] = np.tile(np.arange(n), len(MIXES))
    for i, kw in enumerate(MIXES.values()):
        for name, v in kw.items():
            getattr(sa, name)[i * n:(i + 1) * n] = v
    logits = jnp.broadcast_to(jnp.asarray(row), (S, V))
    counts = jnp.zeros((1, V), jnp.int32)
    out = []
    for draw, select in (("threefry", "topk"), ("hash", "sort")):
        set_methods(draw, select, floor=draw == "hash")
        res, *_ = sampler()(logits, SamplingArrays(*map(jnp.asarray, sa)), counts)
        toks = np.asarray(res.tokens)
        for i, (mix, kw) in enumerate(MIXES.items()):
            got = np.bincount(toks[i * n:(i + 1) * n], minlength=V)
            q = filtered(row, **kw)
            kept = q > 0
            big = kept & (q * n >= 5)  # chi-square bins: expected >= 5; the rest pooled
            f_obs = np.append(got[big], got[kept & ~big].sum())
            f_exp = np.append(n * q[big], n * q[kept & ~big].sum())
            if f_exp[-1] < 5:  # pool too small for its own bin: fold it into the last
                f_obs, f_exp = f_obs[:-1], f_exp[:-1]
                f_obs[-1] += got[kept & ~big].sum()
                f_exp[-1] += n * q[kept & ~big].sum()
            excl = int(got[~kept].sum())  # any: a failure (and chisquare's sums differ)
            pv = stats.chisquare(f_obs, f_exp).pvalue if excl == 0 else 0.0
            tag = f"{draw}/{select}{'/floor' * (draw == 'hash')}"
            out.append((f"distribution {tag} {mix}", bool(excl == 0 and pv > P_MIN),
                        f"p={pv:.3g} kept={int(kept.sum())} excluded drawn={excl}"))
    return out


def check_invariance(rng, V: int) -> list[tuple[str, bool, str]]:
    import jax.numpy as jnp

    from benchmarks.sampling_cost import ALL, params
    from benchmarks.sampling_cost import MIXES as COST_MIXES

    set_methods("hash", "sort", True)
    run = sampler()
    out = []
    row = (rng.standard_normal(V) * 3).astype(np.float32)
    for mix in ("top_p", "top_k_top_p", "all"):
        bad = 0
        for index in range(4):
            alone = params(1, COST_MIXES[mix])
            alone.seeds[:] = [11, 13]
            alone.sample_index[:] = index
            alone.slots[:] = 0
            big = params(256, {k: ("half", v) for k, v in ALL.items()})
            big.seeds[:] = rng.integers(0, 1000, (256, 2))
            for name in alone._fields:
                getattr(big, name)[100] = getattr(alone, name)[0]
            big.slots[100] = 100
            lg = (rng.standard_normal((256, V)) * 3).astype(np.float32)
            lg[100] = row
            cnt = np.zeros((257, V), np.int32)
            cnt[100, :64] = 1
            a, *_ = run(jnp.asarray(row[None]), SamplingArrays_(alone),
                       jnp.asarray(cnt[100:102]))  # its slot's row, then scratch
            b, *_ = run(jnp.asarray(lg), SamplingArrays_(big), jnp.asarray(cnt))
            bad += not (int(a.tokens[0]) == int(b.tokens[100])
                        and np.asarray(a.logprobs)[0] == np.asarray(b.logprobs)[100]
                        and np.array_equal(np.asarray(a.top_ids)[0],
                                           np.asarray(b.top_ids)[100]))
        out.append((f"invariance S=1 vs row 100 of 256, hash/sort/floor, {mix}", bad == 0,
                    f"{bad} of 4 indices differ"))
    return out


def check_compaction(rng, V: int) -> list[tuple[str, bool, str]]:
    import jax
    import jax.numpy as jnp

    from benchmarks.kernels.bench_nucleus_compact import near_prefix
    from jaxinfer import sampling_filters as sf
    from pallas_kernels.sampling import threshold_search as ts

    B = 256
    kw = {"interpret": jax.default_backend() != "gpu", "split": False}
    x = rng.standard_normal((B, V)) * rng.choice([1.0, 3.0, 8.0], B)[:, None]
    p = rng.choice([0.5, 0.9, 0.99], B).astype(np.float32)
    xs = jnp.asarray(x, jnp.float32)
    top, pp = jnp.max(xs, -1), jnp.asarray(p)
    kth, kk = jnp.full((B,), -jnp.inf, jnp.float32), jnp.full((B,), V, jnp.int32)
    lo = sf.nucleus_floor(top, kth, kk, pp)
    full = np.asarray(ts.nucleus_cut(xs, top, kth, kk, pp, lo=lo, compact=0, **kw))
    cut, stats = ts.nucleus_cut(xs, top, kth, kk, pp, lo=lo, return_stats=True, **kw)
    cut, stats = np.asarray(cut), np.asarray(stats)
    diff = np.nonzero(cut != full)[0]
    xf = np.asarray(xs, np.float64)
    near = [near_prefix(xf[i], float(p[i])) for i in diff]  # float32 rounding decides there
    bad_ref = 0
    for i in range(8):
        q = np.sort(xf[i])[::-1]
        w = np.exp(q - q[0])
        before = (np.cumsum(w) - w) / w.sum()
        n = max(int((before < p[i]).sum()), 1)
        bad_ref += not np.array_equal(xf[i] >= cut[i], xf[i] >= q[n - 1])
    alone = [float(np.asarray(ts.nucleus_cut(*(a[i:i + 1] for a in (xs, top, kth, kk, pp)),
                                             lo=lo[i:i + 1], **kw))[0]) for i in (0, 100, 255)]
    same_alone = alone == [float(cut[i]) for i in (0, 100, 255)]
    copied = stats[:, 1] >= 0
    detail = (f"passes over the row mean {stats[:, 0].mean():.2f} max {stats[:, 0].max()}; "
              f"{copied.sum()} of {B} rows copied (mean {stats[copied, 1].mean():.0f} "
              f"elements); impl {'interpret' if kw['interpret'] else 'gpu'}")
    return [(f"compaction: cut == full passes, B={B} ({len(diff)} differ, all near a "
             f"prefix mass: {all(near)})", bool(all(near)), detail),
            ("compaction: kept tokens == float64 sort, 8 rows", bad_ref == 0,
             f"{bad_ref} rows differ"),
            ("compaction: row alone == in the batch (rows 0, 100, 255)", same_alone, "")]


def SamplingArrays_(host):  # noqa: N802 (host numpy arrays -> device arrays)
    import jax.numpy as jnp

    from jaxinfer.batch import SamplingArrays

    return SamplingArrays(*map(jnp.asarray, host))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--draws", type=int, default=2048, help="draws per mix (check 3)")
    ap.add_argument("--smoke", action="store_true", help="vocab 4096, 1024 draws; no record")
    a = ap.parse_args()
    if a.smoke:
        a.vocab, a.draws = 4096, 1024
    import jax

    seed = time.time_ns() % 2 ** 32
    rng = np.random.default_rng(seed)
    print(f"device {jax.devices()[0].device_kind}, vocab {a.vocab}, seed {seed}", flush=True)
    t0, results = time.perf_counter(), []
    for name, check in (("select", lambda: check_select(rng, a.vocab)),
                        ("hash", lambda: check_hash(rng, a.vocab)),
                        ("distribution", lambda: check_distribution(rng, a.vocab, a.draws)),
                        ("invariance", lambda: check_invariance(rng, a.vocab)),
                        ("compaction", lambda: check_compaction(rng, a.vocab))):
        try:
            results += check()
        except Exception as e:  # noqa: BLE001 (a failing check is reported, the rest run)
            results.append((name, False, f"{type(e).__name__}: {str(e)[:300]}"))
        print(f"[{time.perf_counter() - t0:.0f} s] {results[-1]}", flush=True)
    failed = [r for r in results if not r[1]]
    if not a.smoke:
        record("sampling_check", len(failed), "failed checks",
               {"vocab": a.vocab, "seed": seed, "draws_per_mix": a.draws,
                "checks": [{"check": n, "ok": ok, "detail": d} for n, ok, d in results],
                "seconds": time.perf_counter() - t0}, out_dir=a.out)
    print(f"\n{len(results) - len(failed)} of {len(results)} checks passed "
          f"({time.perf_counter() - t0:.0f} s)")
    print("| check | ok | detail |\n|---|---|---|")
    for n, ok, d in results:
        print(f"| {n} | {'yes' if ok else '**NO**'} | {d} |")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
