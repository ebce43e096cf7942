"""Host cost of dispatching an XLA:GPU program, by what it carries (H200 probe).

(1) arguments: a compiled program that ignores N small arguments (``keep_unused=True``, so
    all N reach the executable) — the per-buffer cost of a call; with D of them donated;
(2) kernels: a chain of K dependent elementwise kernels (``optimization_barrier`` keeps them
    apart) — the per-kernel launch cost with XLA's command buffers on (default), off, and
    with the graph's nodes serialized (a straight-line graph) or concurrent;
(3) Triton custom calls: K Pallas kernels in a chain, the same way.
Each row: host ms until the call returns (median of 30), ms waited, ms back to back.

  PYTHONPATH=. python3 benchmarks/dispatch_probe.py --out $OUT/probe
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def timed(fn, args, n=30):
    import jax

    jax.block_until_ready(fn(*args))
    disp, sync = [], []
    for _ in range(n):
        t0 = time.perf_counter()
        r = fn(*args)
        t1 = time.perf_counter()
        jax.block_until_ready(r)
        disp.append(t1 - t0)
        sync.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    for _ in range(n):
        r = fn(*args)
    jax.block_until_ready(r)
    b2b = (time.perf_counter() - t0) / n
    return {"dispatch_ms": 1e3 * float(np.median(disp)), "sync_ms": 1e3 * float(np.median(sync)),
            "b2b_ms": 1e3 * b2b}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/probe")
    ns = ap.parse_args()
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    rows = {}
    for n in (1, 64, 323, 1000):
        args = [jnp.full((256,), i, jnp.float32) for i in range(n)]
        f = jax.jit(lambda *a: a[0][:1] + 1, keep_unused=True)
        rows[f"args{n}"] = timed(f, args)
    args = [jnp.full((256,), i, jnp.float32) for i in range(64)]
    f = jax.jit(lambda *a: [x + 1 for x in a], donate_argnums=tuple(range(64)))

    def donated(_args=[args]):  # noqa: B006 - thread the donated buffers
        _args[0] = f(*_args[0])
        return _args[0]

    rows["donate64_update64"] = timed(lambda: donated(), ())

    def chain(x, k):
        for _ in range(k):
            x = jax.lax.optimization_barrier(jnp.sin(x) + 1.0)
        return x

    def tri(x_ref, o_ref):
        o_ref[...] = jnp.sin(x_ref[...]) + 1.0

    def tri_chain(x, k):
        for _ in range(k):
            x = pl.pallas_call(tri, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                               interpret=jax.default_backend() == "cpu")(x)
        return x

    x = jnp.ones((1024,), jnp.float32)
    for opts_name, opts in (("cb_default", {}), ("cb_off", {"xla_gpu_enable_command_buffer": ""}),
                            ("serialize", {"xla_gpu_command_buffer_scheduling_mode": "SERIALIZE"}),
                            ("concurrent",
                             {"xla_gpu_command_buffer_scheduling_mode": "CONCURRENT"})):
        for k in ((20,) if jax.default_backend() == "cpu" else (100, 500)):
            for kind, fn in (("fusions", chain), ("triton", tri_chain)):
                c = jax.jit(fn, static_argnums=1).lower(x, k).compile(compiler_options=opts)
                rows[f"{kind}{k}_{opts_name}"] = timed(lambda c=c: c(x), ())
    Path(ns.out).mkdir(parents=True, exist_ok=True)
    (Path(ns.out) / "dispatch_probe.json").write_text(json.dumps(
        {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "rows": rows}, indent=1))
    print(f"{'case':>26} {'dispatch':>9} {'sync':>8} {'b2b':>8} ms")
    for k, v in rows.items():
        print(f"{k:>26} {v['dispatch_ms']:9.3f} {v['sync_ms']:8.3f} {v['b2b_ms']:8.3f}")


if __name__ == "__main__":
    main()
