"""The steps the threshold-search kernels (:mod:`pallas_kernels.sampling.threshold_search`,
whose docstring explains the method) are built from, inside a Pallas GPU kernel (Triton
lowering): pivots and bracket narrowing in the order-key image of float32, row sweeps that
measure counts or masses at several thresholds per read, the bracket's compacted copy and its
measure, and the search loop. Pure functions of refs and traced scalars; no pallas_call here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu

from jaxinfer.order_keys import key_value

U32 = jnp.uint32
LO = 0x007FFFFF  # order_key(-inf): the k-th search's lower bound


def pivot_keys(lo: jax.Array, hi: jax.Array, P: int) -> list[jax.Array]:
    """P uint32 pivots in (lo, hi], as ``sampling_filters._largest_passing`` spreads them."""
    width = hi - lo
    step = width // U32(P + 1) + U32(1)
    return [lo + jnp.minimum(U32(j) * step, width) for j in range(1, P + 1)]


def narrow(lo, hi, piv: Sequence[jax.Array], ok: Sequence[jax.Array]):
    """New bracket: lo to the largest passing pivot, hi below the smallest failing one."""
    new_lo, new_hi = lo, hi
    for p, o in zip(piv, ok):
        new_lo = jnp.maximum(new_lo, jnp.where(o, p, lo))
        new_hi = jnp.minimum(new_hi, jnp.where(o, hi, p - U32(1)))
    return new_lo, jnp.maximum(new_hi, new_lo)


def load_blocks(x_ref, row, i, g: dict) -> tuple:
    """Loop iteration ``i``'s U blocks of N elements of row ``row`` (masked past V: -inf)."""
    V, N, U = g["V"], g["N"], g["U"]
    lanes = jnp.arange(N, dtype=jnp.int32)
    out = []
    for u in range(U):
        idx = (i * U + u) * N + lanes
        out.append(plgpu.load(x_ref.at[row, idx], mask=idx < V, other=-jnp.inf)
                   if g["masked"] else plgpu.load(x_ref.at[row, idx]))
    return tuple(out)


def sweep(x_ref, row, s0, ns, *, g: dict, ts: Sequence[jax.Array], top=None,
           above=None, counts: bool = False) -> list[jax.Array]:
    """Measures of segments [s0, s0 + ns) of row ``row`` of ``x_ref`` [S, V], segment sums
    added in order: per threshold t of ``ts`` the count (``top`` None, int32) or the mass
    ``sum exp(x - top)`` (float32) of x >= t; with ``counts`` (mass mode) then also the int32
    count of x >= t per threshold; with ``above``, last the count and mass of x > above.
    ``g``: geometry (:func:`geometry`)."""
    SI = g["SI"]
    last = g["n_seg"] * SI - 1
    n = len(ts)
    both = counts and top is not None

    def add(accs, xs):
        accs = list(accs)
        for x in xs:
            one = jnp.ones((x.shape[0],), jnp.int32)
            w = one if top is None else jnp.exp(x - top)
            ge = [x >= t for t in ts]
            accs[:n] = [a + jnp.where(m, w, 0) for a, m in zip(accs, ge)]
            if both:
                accs[n:2 * n] = [a + m.astype(jnp.int32) for a, m in zip(accs[n:2 * n], ge)]
            if above is not None:
                gt = x > above
                accs[-2] = accs[-2] + jnp.where(gt, one, 0)
                accs[-1] = accs[-1] + jnp.where(gt, w, 0.0)
        return tuple(accs)

    dts = [jnp.int32 if top is None else jnp.float32] * n + [jnp.int32] * (n if both else 0)
    dts += [jnp.int32, jnp.float32] if above is not None else []

    def segment(s, carry):
        tots, xs = carry

        def step(t, c):
            accs, xs = c
            i = s * SI + t
            nxt = load_blocks(x_ref, row, i + 1 if g["masked"] else jnp.minimum(i + 1, last),
                               g)  # in flight while this iteration's blocks are measured
            return add(accs, xs), nxt

        zeros = tuple(jnp.zeros((g["N"],), d) for d in dts)
        accs, xs = jax.lax.fori_loop(0, SI, step, (zeros, xs))
        return tuple(a + jnp.sum(b) for a, b in zip(tots, accs)), xs

    tots = tuple(jnp.zeros((), d) for d in dts)
    first = load_blocks(x_ref, row, s0 * SI, g)
    return list(jax.lax.fori_loop(s0, s0 + ns, segment, (tots, first))[0])


def copy_bracket(x_ref, buf_ref, row, vlo, vup, bounded, *, g: dict,
                 capacity: int) -> jax.Array:
    """Copy the elements of row ``row`` with ``x >= vlo`` and, when ``bounded``, not
    ``x >= vup`` into ``buf_ref[row]``, in row order, and return how many (int32).

    These are exactly the elements the tracked counts put inside the bracket: ``vlo`` is the
    value of its lower key (count(x >= vlo) measured there) and ``vup`` the value of the key
    above its upper end, the smallest failing pivot, whose count and mass of ``x >= vup`` are
    carried as "above the bracket" (:func:`narrow_tracked`); ``bounded`` False: no pivot has
    failed yet, nothing lies above. The same predicates as the sweeps, not ``x <= value(hi)``:
    the keys of -0.0 and +0.0 both map to 0.0 (and a backend that flushes subnormals compares
    them as 0), so a value test on ``hi`` could put an element both above and inside. The
    caller knows there are at most ``capacity``; lanes that copy nothing, and any past the
    capacity (memory safety only: never reached), write nowhere (on the GPU: masked) or to slot
    ``capacity`` (the interpreter's read-modify-write: a dump slot no copied element shares).
    """
    V, N, U, SI = g["V"], g["N"], g["U"], g["SI"]
    lanes = jnp.arange(N, dtype=jnp.int32)
    last = g["n_seg"] * SI - 1

    def step(i, c):
        off, xs = c
        nxt = load_blocks(x_ref, row, jnp.minimum(i + 1, last), g)
        for u, x in enumerate(xs):
            idx = (i * U + u) * N + lanes
            m = (idx < V) & (x >= vlo) & ~(bounded & (x >= vup))
            mi = m.astype(jnp.int32)
            n = jnp.sum(mi)

            def copy(x=x, m=m, mi=mi, off=off):  # the scan only where the block has some
                pos = off + jnp.cumsum(mi) - mi
                ok = m & (pos < capacity)
                plgpu.store(buf_ref.at[row, jnp.where(ok, pos, capacity)], x, mask=ok)

            jax.lax.cond(n > 0, copy, lambda: None)
            off = off + n
        return off, nxt

    return jax.lax.fori_loop(0, last + 1, step, (jnp.int32(0), load_blocks(x_ref, row, 0, g)))[0]


def copy_measure(buf_ref, row, pop, ts: Sequence[jax.Array], top, mass_hi, *,
                    g: dict) -> list[jax.Array]:
    """Masses ``mass_hi + sum exp(x - top)`` over the first ``pop`` elements of
    ``buf_ref[row]`` with x >= t, per threshold t: the compacted phase's measure (blocks of N
    in order, each threshold's [N] accumulator summed once, then added to ``mass_hi``)."""
    N = g["N"]
    lanes = jnp.arange(N, dtype=jnp.int32)

    def block(b, accs):
        idx = b * N + lanes
        x = plgpu.load(buf_ref.at[row, idx], mask=idx < pop, other=-jnp.inf)
        w = jnp.exp(x - top)
        return tuple(a + jnp.where(x >= t, w, 0.0) for a, t in zip(accs, ts))

    zeros = tuple(jnp.zeros((N,), jnp.float32) for _ in ts)
    accs = jax.lax.fori_loop(0, (pop + N - 1) // N, block, zeros)
    return [mass_hi + jnp.sum(a) for a in accs]


def search_loop(lo, hi, P: int, passes: int, measure: Callable, ok: Callable) -> jax.Array:
    """Largest key in [lo, hi] whose measure passes (lo taken to pass), at most ``passes``
    passes of P pivots; stops when the bracket is one key."""
    def cond(c):
        return (c[0] < passes) & (c[1] < c[2])

    def body(c):
        i, lo, hi = c
        piv = pivot_keys(lo, hi, P)
        m = measure([key_value(p) for p in piv])
        lo, hi = narrow(lo, hi, piv, [ok(v) for v in m])
        return i + 1, lo, hi

    return jax.lax.while_loop(cond, body, (jnp.int32(0), lo, hi))[1]


# Per search kind: the row operands, the initial bracket, the measure's extras.
NPARAM = {"kth": 2, "nucleus": 6}


def start_bracket(kind: str, params: list) -> tuple:
    """(lo, hi, row values) of a row from its operands' values."""
    if kind == "kth":
        hi, k = params
        return jnp.where(k <= 1, hi, U32(LO)), hi, {"k": k}  # k <= 1: the maximum
    top, hi, kth, lo, k, p = params
    hi = jnp.where(p >= 1.0, lo, hi)  # top_p 1 keeps the whole top-k: the cut is kth
    return lo, hi, {"top": top, "kth": kth, "k": k, "p": p}


def nucleus_target(v: dict, n_above, mass_above) -> jax.Array:
    """top_p * mass(top k): the elements above kth plus the ties of kth inside the top k."""
    ties = v["k"] - n_above
    w_kth = jnp.where(ties > 0, jnp.exp(v["kth"] - v["top"]), 0.0)
    return v["p"] * (mass_above + ties.astype(jnp.float32) * w_kth)


def narrow_tracked(lo, hi, piv, ok, mass, cnt, st: tuple) -> tuple:
    """:func:`narrow`, also carrying ``st`` = (count(x >= lo), count(x > hi), mass(x > hi)):
    from the largest passing pivot and the smallest failing one (passing pivots are a prefix:
    the mass is non-increasing in the threshold)."""
    cnt_lo, cnt_hi, mass_hi = st
    for o, c in zip(ok, cnt):  # ascending: the last passing pivot sets lo
        cnt_lo = jnp.where(o, c, cnt_lo)
    for o, c, m in reversed(list(zip(ok, cnt, mass))):  # descending: the smallest failing
        cnt_hi = jnp.where(o, cnt_hi, c)
        mass_hi = jnp.where(o, mass_hi, m)
    return (*narrow(lo, hi, piv, ok), (cnt_lo, cnt_hi, mass_hi))


def geometry(V: int, block: int, unroll: int, segment: int) -> dict:
    """The sweep geometry of rows of V elements: N = ``block`` elements a vector step, U =
    ``unroll`` steps an iteration, SI iterations a ``segment``, n_seg segments, masked tail.
    Raises ValueError unless block is a power of two and segment a multiple of block * unroll."""
    if block & (block - 1) or segment % (block * unroll):
        raise ValueError(f"block {block} must be a power of two and segment {segment} a "
                         f"multiple of block * unroll")
    return {"V": V, "N": block, "U": unroll, "SI": segment // (block * unroll),
            "n_seg": -(-V // segment), "masked": V % segment != 0}
