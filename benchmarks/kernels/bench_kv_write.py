"""The engine's KV write (new K/V into their pages by slot mapping) on one GPU: the
``write_kv_ref`` methods (``reference.KV_WRITE_METHODS``) and the Pallas kernel
(``kv_write.write_kv_pallas``, method "kernel") side by side.

Why: profiles of the 8B decode step (e.g. profile_decode_h200_s10call1_fp8_b64: 420 µs of a
6.0 ms step, 6.9 µs a layer for 64 tokens' FP8 K/V) and of Gemma 3 270M (5.7 µs a call with
FP8 KV, 3.3 with bf16) show the two scatter fusions a layer far from the bytes they write.

For each (tokens T, KV heads, D, KV dtype) it first checks every method against "scatter"
(JAX's default): the caches must be bit-identical outside the null page (page 0, where
padding tokens write), with a few padding tokens among the slots. Then it times one jitted
call that writes ``--layers`` layers ``--steps`` times (straight-line writes, the
caches donated and carried, so each write is in place as in the engine):
µs per layer write (K and V), wall clock of back-to-back calls, median of repeats, and the
GB/s of K/V bytes written. The table prints last; records (``make_record``) go to
``--out/kv_write.json``.

    PYTHONPATH=. python3 benchmarks/kernels/bench_kv_write.py --out $OUT/kvw
    PYTHONPATH=. python3 benchmarks/kernels/bench_kv_write.py --cpu-smoke
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

from benchmarks.kernels.kernel_bench import RunRecords  # noqa: E402
from pallas_kernels.paged_attention import reference as ref  # noqa: E402
from pallas_kernels.paged_attention.kv_write import write_kv_pallas  # noqa: E402

F8 = jnp.float8_e4m3fn
# (name, T tokens written a layer, Hkv, D): decode buckets of the 8B shape, a prefill chunk,
# Gemma 3 270M's decode bucket
GRID = [("8b_b1", 1, 8, 128), ("8b_b64", 64, 8, 128), ("8b_b256", 256, 8, 128),
        ("8b_t4096", 4096, 8, 128), ("g270_b32", 32, 1, 256)]
# SmolLM2-135M (3 KV heads, D 64): only when named in --points (the CPU's own A/B)
EXTRA = [("smol_b1", 1, 3, 64), ("smol_b8", 8, 3, 64), ("smol_t512", 512, 3, 64)]
SMOKE = [("smoke", 8, 2, 64)]


def slots_for(T: int, num_pages: int, ps: int, rng, padding: int) -> np.ndarray:
    """T distinct slots on random pages (>= 1), the last ``padding`` tokens on the null
    page's slot 0: below 256 tokens decode-like (one token a row, each row its own page at a
    random offset), else prefill-like (consecutive tokens fill random pages in order)."""
    if T < 256:
        pages = rng.choice(np.arange(1, num_pages), size=T, replace=False)
        slots = pages * ps + rng.integers(0, ps, T)
    else:
        pages = rng.choice(np.arange(1, num_pages), size=-(-T // ps), replace=False)
        t = np.arange(T)
        slots = pages[t // ps] * ps + t % ps
    if padding:
        slots[-padding:] = 0
    return slots.astype(np.int32)


def bits(cache: jax.Array) -> jax.Array:
    """The cache outside the null page as unsigned integers of its width (exact compare)."""
    u = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[jnp.dtype(cache.dtype).itemsize]
    return jax.lax.bitcast_convert_type(cache[:, :, 1:], u)


# the methods: write_kv_ref's, and "kernel" (kv_write.write_kv_pallas, the Pallas kernel)
METHODS = ref.KV_WRITE_METHODS + ("kernel",)
INTERPRET = False  # --cpu-smoke: the kernel in Pallas interpret mode


def make_run(method: str, layers: int, steps: int, scales: bool):
    """A jitted call writing ``layers`` layers ``steps`` times, straight-line (an XLA:GPU
    while loop would add a host round trip an iteration); the layer index comes from an
    input array, so it stays a traced scalar as in the engine's scan."""
    kw = {"k_scale": jnp.float32(0.5), "v_scale": jnp.float32(0.25)} if scales else {}

    def run(kc, vc, kn, vn, slots, layer_ids):
        for i in range(layers * steps):
            # new values differ per write (a step's K/V depend on the step); the barrier
            # rounds them to bf16 for every method (XLA would otherwise fuse the add into a
            # scatter in float32, "excess precision", which the kernel's input never has)
            k = jax.lax.optimization_barrier(kn + jnp.asarray(i, kn.dtype))
            if method == "kernel":
                kc, vc = write_kv_pallas(kc, vc, layer_ids[i % layers], k, vn, slots,
                                         interpret=INTERPRET, **kw)
            else:
                kc, vc = ref.write_kv_ref(kc, vc, layer_ids[i % layers], k, vn, slots,
                                          method=method, **kw)
        return kc, vc

    return jax.jit(run, donate_argnums=(0, 1))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", ""))
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--pages", type=int, default=4096, help="pages a layer's pool holds")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--points", default="",
                   help="comma-separated GRID / EXTRA names (default: all of GRID)")
    p.add_argument("--kv", default="bfloat16,float8_e4m3fn", help="KV dtypes to run")
    p.add_argument("--deadline-s", type=float, default=150.0)
    p.add_argument("--cpu-smoke", action="store_true")
    args = p.parse_args(argv)
    global INTERPRET
    INTERPRET = args.cpu_smoke
    t0 = time.time()
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    records = RunRecords("benchmarks/kernels/bench_kv_write.py", args.out or None,
                         "kv_write.json")
    grid = SMOKE if args.cpu_smoke else [g for g in GRID + EXTRA if g[0] in args.points.split(",")
                                         or (not args.points and g in GRID)]
    layers, steps, pages = (2, 2, 64) if args.cpu_smoke else (args.layers, args.steps,
                                                               args.pages)
    methods = args.methods.split(",")
    rng = np.random.default_rng(0)
    ps, table, failures = 16, [], 0
    for name, T, Hkv, D in grid:
        for dt in [jnp.dtype(k) for k in args.kv.split(",")]:
            if time.time() - t0 > args.deadline_s:
                print("deadline: skipping", name, jnp.dtype(dt).name, flush=True)
                continue
            shape = (layers, Hkv, pages, ps, D)
            slots = jnp.asarray(slots_for(T, pages, ps, rng, padding=min(3, T - 1)))
            kn = jnp.asarray(rng.standard_normal((T, Hkv, D)), jnp.bfloat16)
            vn = jnp.asarray(rng.standard_normal((T, Hkv, D)), jnp.bfloat16)
            fp8 = dt == F8
            lids = jnp.arange(layers, dtype=jnp.int32)
            outs, row = {}, {"point": name, "kv": jnp.dtype(dt).name}
            for m in methods:  # compared on the device, as bits (no 2 GB host copies)
                run = make_run(m, layers, 1, fp8)
                kc, vc = run(jnp.full(shape, 3, dt), jnp.full(shape, 3, dt), kn, vn, slots, lids)
                outs[m] = (bits(kc), bits(vc))
                del kc, vc
            base = outs[methods[0]]
            for m in methods[1:]:
                same = all(bool(jnp.array_equal(a, b)) for a, b in zip(outs[m], base))
                if not same:
                    failures += 1
                    print(f"CHECK FAILED {name} {row['kv']} {m} differs from {methods[0]}")
                row[f"{m}_ok"] = same
            del outs, base
            kv_bytes = 2 * T * Hkv * D * jnp.dtype(dt).itemsize  # K and V, one layer
            for m in methods:
                run = make_run(m, layers, steps, fp8)
                kc, vc = jnp.zeros(shape, dt), jnp.zeros(shape, dt)
                kc, vc = jax.block_until_ready(run(kc, vc, kn, vn, slots, lids))
                res = []
                for _ in range(args.repeats):
                    n = 5
                    t = time.perf_counter()
                    for _ in range(n):
                        kc, vc = run(kc, vc, kn, vn, slots, lids)
                    jax.block_until_ready(kc)
                    res.append((time.perf_counter() - t) / (n * layers * steps))
                us = 1e6 * float(np.median(res))
                del kc, vc
                row[m] = us
                cfg = {"point": name, "T": T, "Hkv": Hkv, "D": D, "page": ps,
                       "kv_dtype": row["kv"], "method": m, "layers": layers, "steps": steps,
                       "pages": pages, "us_per_layer_write": us,
                       "check_vs_" + methods[0]: row.get(f"{m}_ok", True)}
                records.add(f"kv_write/{m}/{name}/{row['kv']}", kv_bytes / us / 1e3, "GB/s", cfg)
                print(f"{name:9s} {row['kv']:14s} {m:8s} {us:8.2f} us/layer "
                      f"{kv_bytes / us / 1e3:8.1f} GB/s", flush=True)
            table.append(row)
    print(f"\nKV write (K and V, one layer) on {jax.devices()[0].device_kind}: us per layer write"
          f" ({layers} layers x {steps} steps a call, wall clock)")
    print(f"{'point':9s} {'kv':14s} " + " ".join(f"{m:>9s}" for m in methods) + "  checks")
    for r in table:
        ok = all(r.get(f"{m}_ok", True) for m in methods)
        print(f"{r['point']:9s} {r['kv']:14s} " + " ".join(
            f"{r.get(m, float('nan')):9.2f}" for m in methods) + f"  {'ok' if ok else 'FAIL'}")
    if failures:
        raise SystemExit(f"{failures} check(s) failed")


if __name__ == "__main__":
    main()
