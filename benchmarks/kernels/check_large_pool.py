"""Paged decode attention over an engine-sized KV pool: correctness and speed (GPU).

    PYTHONPATH=. python3 benchmarks/kernels/check_large_pool.py --out $OUT [--pages 36000]

The kernel benchmarks (bench_paged_attention.py) use pools sized to their batch; the engine's
pool fills the device (Llama-3.1-8B bf16, 36,000 pages: K and V are [32, 8, 36000, 16, 128],
1.18e10 elements each, beyond int32 offsets). This checks, on fresh random inputs:

1. correctness against ``paged_decode_attention_ref`` at the last layer with block tables
   pointing at the pool's last pages (offsets past 2^31 elements), random page permutation;
2. speed at B 256 x ctx 1536 and B 128 x ctx 3072 with a 272-page block table (the bench
   suite's decode shapes), beside the same batch and context in a pool just large enough
   (so a difference is the pool's size, not the shape); KV GB/s against the copy bandwidth
   measured in the same run.

Prints a table last; JSON records under ``--out``.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernel_bench import RunRecords, rel_err, time_fn  # noqa: E402

from jaxinfer.bench.roofline import measure_ceilings  # noqa: E402
from pallas_kernels.paged_attention.decode import paged_decode_attention  # noqa: E402
from pallas_kernels.paged_attention.reference import paged_decode_attention_ref  # noqa: E402

L, HKV, HQ, PS, D = 32, 8, 32, 16, 128


def random_pool(key, pages: int, layers: int = L):
    """K, V [L, Hkv, pages, ps, D] bf16 of random sign and mantissa, magnitude in [0.5, 1),
    made on the device one layer at a time (no float32 copy of a 38 GB cache)."""
    shape = (HKV, pages, PS, D)

    @jax.jit
    def layer_values(k):
        bits = jax.random.bits(k, shape, jnp.uint16)
        return jax.lax.bitcast_convert_type((bits & 0x807F) | 0x3F00, jnp.bfloat16)

    @functools.partial(jax.jit, donate_argnums=0)
    def put(cache, i, vals):
        return jax.lax.dynamic_update_index_in_dim(cache, vals, i, 0)

    caches = []
    for c in range(2):
        cache = jnp.zeros((layers, *shape), jnp.bfloat16)
        for i in range(layers):
            cache = put(cache, i, layer_values(jax.random.fold_in(key, c * 1000 + i)))
        caches.append(cache)
    return caches[0], caches[1]


def tables(rng, B: int, ctx: int, width: int, pages: int, top: bool) -> np.ndarray:
    """[B, width] distinct random page ids (from the pool's top when ``top``), 0-padded."""
    n = -(-ctx // PS)
    lo = pages - B * n if top else 1
    ids = rng.permutation(np.arange(lo, lo + B * n, dtype=np.int32)).reshape(B, n)
    bt = np.zeros((B, width), np.int32)
    bt[:, :n] = ids
    return bt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/large_pool")
    ap.add_argument("--pages", type=int, default=36000)
    ap.add_argument("--width", type=int, default=272)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    Path(a.out).mkdir(parents=True, exist_ok=True)
    rec = RunRecords("benchmarks/kernels/check_large_pool.py", a.out,
                     "check_large_pool_h200.json")
    copy_gbps = measure_ceilings("bfloat16")["copy_bytes_per_s"] / 1e9
    rng = np.random.default_rng(0)
    key = jax.random.key(0)
    rows = []
    k_cache, v_cache = random_pool(key, a.pages)
    print(f"pool {k_cache.shape} {k_cache.dtype}: {k_cache.size:.3e} elements per cache "
          f"(int32 max 2.1e9); copy {copy_gbps:,.0f} GB/s", flush=True)
    scale = D ** -0.5
    # 1. correctness at the pool's top, last layer, ragged lengths incl. 1 and page edges
    B = 16
    lens = np.array([1, 16, 17, 1536, 3000, 31, 32, 33, 4000, 2048, 100, 5, 999, 1000,
                     4096, 4352], np.int32)
    bt = tables(rng, B, int(lens.max()), a.width, a.pages, top=True)
    q = jax.random.normal(jax.random.key(1), (B, HQ, D), jnp.bfloat16)
    for layer in (0, L - 1):
        out = paged_decode_attention(q, k_cache, v_cache, jnp.int32(layer), jnp.asarray(bt),
                                     jnp.asarray(lens), scale=scale)
        ref = paged_decode_attention_ref(q, k_cache, v_cache, jnp.int32(layer),
                                         jnp.asarray(bt), jnp.asarray(lens), scale=scale)
        err = rel_err(out, ref)
        ok = bool(np.isfinite(np.asarray(out, np.float32)).all()) and err < 2e-2
        print(f"correctness layer {layer}, top pages: rel err {err:.2e} -> "
              f"{'PASS' if ok else 'FAIL'}", flush=True)
        rec.add(f"rel_err_layer{layer}", err, "rel", {"pages": a.pages, "B": B, "ok": ok})
        rows.append((f"correct L{layer} (top pages)", f"{err:.1e}", "PASS" if ok else "FAIL"))
    # 2. speed: engine-sized pool vs a pool just large enough, same shapes
    shapes = ((256, 1536), (128, 3072), (32, 2048))

    def timed(label: str, B: int, ctx: int, width: int, kc, vc, layer: int, pages: int,
              top: bool) -> None:
        """Time one case, add its row and record (KV GB/s of the B x ctx tokens read)."""
        q = jax.random.normal(jax.random.key(2), (B, HQ, D), jnp.bfloat16)
        lens = jnp.full((B,), ctx, jnp.int32)
        bt = jnp.asarray(tables(rng, B, ctx, width, pages, top=top))
        # The caches are arguments: a closure would capture them (75 GB) as program
        # constants (the 2026-12-01 run died of it).
        f = jax.jit(lambda q, bt, kc, vc: paged_decode_attention(
            q, kc, vc, jnp.int32(layer), bt, lens, scale=scale))
        t = time_fn(f, [(q, bt, kc, vc)], a.repeats)
        gbps = 2 * B * ctx * HKV * D * 2 / t / 1e9
        rows.append((f"B{B} ctx{ctx} w{width} {label}", f"{t * 1e3:.3f} ms",
                     f"{gbps:,.0f} GB/s ({gbps / copy_gbps:.0%})"))
        rec.add(f"kv_gbps_B{B}_ctx{ctx}_w{width}_{label.replace(' ', '_')}", gbps, "GB/s",
                {"B": B, "ctx": ctx, "width": width, "pages": pages, "ms": t * 1e3,
                 "copy_gbps": copy_gbps})

    for B, ctx in shapes:
        timed("engine pool", B, ctx, a.width, k_cache, v_cache, L - 1, a.pages, top=True)
    del k_cache, v_cache
    for B, ctx in shapes:
        n = -(-ctx // PS)
        pages = B * n + 1
        kc, vc = random_pool(jax.random.key(3), pages, layers=1)
        for width in (a.width, n):
            timed("small pool", B, ctx, width, kc, vc, 0, pages, top=False)
        del kc, vc
    print(f"records: {a.out}/check_large_pool_h200.json")
    for r in rows:
        print(" | ".join(str(c) for c in r))


if __name__ == "__main__":
    main()
