"""Device check of jaxinfer.row_reduce at the sampler's shape: the two-stage row max / argmax
equal jnp's one-stage ones on fresh random [256, 128256] float32 rows with ties and -inf, and
their device times side by side (profiler-free: median wall of 50 calls in one jit each).

    PYTHONPATH=. python3 benchmarks/row_reduce_check.py [--chunks 64,128,256]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.row_reduce import row_argmax, row_max


def wall_us(f, x, n: int = 50) -> float:
    jax.block_until_ready(f(x))
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        jax.block_until_ready(f(x))
        ts.append(time.perf_counter() - t0)
    return 1e6 * float(np.median(ts))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", default="64,128,256")
    a = ap.parse_args()
    seed = int(time.time())
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((256, 128256)).astype(np.float32)
    x[0, [7, 100000]] = 40.0
    x[1, :] = -np.inf
    x[2, rng.integers(0, 128256, 50000)] = -np.inf
    xj = jnp.asarray(x)
    ref_i, ref_m = jax.jit(lambda x: jnp.argmax(x, -1))(xj), jax.jit(lambda x: jnp.max(x, -1))(xj)
    print(f"seed {seed}; one stage: argmax {wall_us(jax.jit(lambda x: jnp.argmax(x, -1)), xj):.1f}"
          f" us, max {wall_us(jax.jit(lambda x: jnp.max(x, -1)), xj):.1f} us")
    for c in (int(v) for v in a.chunks.split(",")):
        fi = jax.jit(lambda x, c=c: row_argmax(x, c))
        fm = jax.jit(lambda x, c=c: row_max(x, c))
        same = (np.array_equal(np.asarray(fi(xj)), np.asarray(ref_i))
                and np.array_equal(np.asarray(fm(xj)), np.asarray(ref_m)))
        print(f"chunks {c}: equal {same}; argmax {wall_us(fi, xj):.1f} us, "
              f"max {wall_us(fm, xj):.1f} us")
        if not same:
            raise SystemExit(f"row_reduce differs from jnp at chunks {c}")


if __name__ == "__main__":
    main()
