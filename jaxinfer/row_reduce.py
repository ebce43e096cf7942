"""Row max / argmax over a long last axis in two stages, for the sampler's [S, V] reductions.

At S = 256 rows of a 128k vocabulary, XLA:GPU reduces each row in one thread block: 256
blocks for 132 SMs, too few loads in flight to stream the 131 MB at the card's bandwidth (the
sampler's row reductions ran at ~1.2-1.5 TB/s on the H200, benchmarks/RESULTS.md "Sampling
cost", session 7). Reducing [S, C, V / C] over its last axis first gives XLA S * C rows to
spread; the second stage reduces [S, C]. Both functions are exact: a maximum does not depend
on the order of comparisons, and the argmax keeps the first index of the maximum (NaN counted
as the maximum, as ``jnp.argmax``), so results equal the one-stage ``jnp`` reductions bit for
bit, at any S (batch invariance is unaffected).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def num_chunks(v: int, target: int) -> int:
    """The divisor C of ``v`` closest to ``target`` (at least 1) with chunks of at least 512
    elements; 1 (one stage) when ``target`` <= 1 or no such divisor above 1 exists."""
    if target <= 1:
        return 1
    best = 1
    for c in range(2, v // 512 + 1):
        if v % c == 0 and abs(c - target) < abs(best - target):
            best = c
    return best


def row_max(x: jax.Array, target_chunks: int = 0) -> jax.Array:
    """[S, V] -> [S] maximum over the last axis (same value as ``jnp.max(x, -1)``; a row
    with NaN gives what XLA's max gives, which is the backend's: XLA:GPU propagates NaN,
    XLA:CPU's fast min/max may drop it, depending on the order).

    ``target_chunks``: about how many chunks a row is cut into for the first stage (0 or 1:
    one stage). Raises ValueError unless ``x`` is 2-D."""
    if x.ndim != 2:
        raise ValueError(f"row_max: x must be [S, V], got shape {x.shape}")
    S, V = x.shape
    c = num_chunks(V, target_chunks)
    if c == 1:
        return jnp.max(x, axis=-1)
    return jnp.max(jnp.max(x.reshape(S, c, V // c), axis=-1), axis=-1)


def _first_max(a: tuple[jax.Array, jax.Array], b: tuple[jax.Array, jax.Array]):
    """Combiner of (value, index) pairs: the larger value, NaN above all, the lower index on
    ties (as ``jnp.argmax``). Commutative and associative, so any reduction order agrees."""
    (av, ai), (bv, bi) = a, b
    a_nan, b_nan = jnp.isnan(av), jnp.isnan(bv)
    take_a = jnp.where(a_nan | b_nan, a_nan & (~b_nan | (ai < bi)),
                       (av > bv) | ((av == bv) & (ai < bi)))
    return jnp.where(take_a, av, bv), jnp.where(take_a, ai, bi)


def row_argmax(x: jax.Array, target_chunks: int = 0) -> jax.Array:
    """[S, V] -> [S] int32 index of the first maximum of each row (``jnp.argmax(x, -1)``).

    Stage 1 reduces (value, index) pairs within each chunk with one variadic reduction,
    stage 2 the [S, C] pairs. Raises ValueError unless ``x`` is 2-D."""
    if x.ndim != 2:
        raise ValueError(f"row_argmax: x must be [S, V], got shape {x.shape}")
    S, V = x.shape
    c = num_chunks(V, target_chunks)
    if c == 1:
        return jnp.argmax(x, axis=-1).astype(jnp.int32)
    xr = x.reshape(S, c, V // c)
    idx = lax.broadcasted_iota(jnp.int32, xr.shape, 2) + lax.broadcasted_iota(
        jnp.int32, xr.shape, 1) * (V // c)
    init = (jnp.array(-jnp.inf, x.dtype), jnp.array(V, jnp.int32))
    vals, ids = lax.reduce((xr, idx), init, _first_max, (2,))
    _, out = lax.reduce((vals, ids), init, _first_max, (1,))
    return out
