"""Exact top-k / top-p threshold search of a row in one Pallas GPU kernel launch (Triton lowering).

The jnp reference is :mod:`jaxinfer.sampling_filters` (``kth_largest``, ``nucleus_cut``); its
module docstring explains the method: the k-th largest value is the largest threshold t with
``count(x >= t) >= k``, the top-p cut the largest t >= kth with
``mass(x >= t) >= top_p * mass(top k)``, found by narrowing a bracket in the order-preserving
uint32 image of float32 (``order_key``) by ``P + 1`` per pass, P thresholds compared per pass
(the pivot search of FlashInfer's sorting-free sampling, ``top_k_mask_logits`` /
``top_p_renorm_probs``, and of vLLM's Qrita kernels). XLA runs each pass as a few kernels:
a variadic P-output row reduction (far from memory-bound on the H200: ~120 us a pass at
[256, 128256] f32 against ~30 us for one read of the logits) and the bracket updates, so
that at batch 1 a search is ~50 small launches. Here one program per row runs every pass:

* the bracket [lo, hi] stays in registers; a ``lax.while_loop`` runs at most
  ``search_passes(P)`` passes and stops early once lo == hi (rows with k <= 1 or top_p >= 1
  start closed: no pass);
* a pass walks the row in steps of ``block`` elements, ``unroll`` steps per loop iteration,
  the next iteration's loads issued before this one's compares (register prefetch). Each of
  the P thresholds keeps a [block] accumulator (int32 counts, or float32 masses
  ``exp(x - top)``), summed once at the end of the pass. The tail past V is masked (-inf,
  which no threshold reaches and whose mass is 0);
* the pivots, the bracket update and the final key are the jnp search's ops on scalars, so
  both visit the same brackets; the nucleus search computes ``mass(top k)`` (count and mass
  of x > kth) in its first pass instead of a pass of its own.

Results. ``kth_largest``: the same float32 value, bit for bit (counts are exact). The result
does not depend on P either: the search returns the largest key whose measure passes,
whichever pivots visit it. ``nucleus_cut``: the masses are summed in another order than XLA's
(per-lane sums over the row, then a tree), and ``exp`` is CUDA's ``expf``, so where
``top_p * mass(top k)`` sits within float32 rounding of a prefix mass the two may cut one
value apart -- the tolerance of the jnp search itself against a sorted cumulative sum
(tests/core/test_sampling_filters.py). The kernel's masses are a monotone function of the
threshold (same summation order for every threshold, round-to-nearest is monotone), so its
cut does not depend on P, nor on S or the other rows. Inputs with subnormal floats may differ
where a backend flushes them (XLA:CPU compares them as 0).

Cost model (not measured when written; ``benchmarks/kernels/bench_sampling_search.py``
measures it). Per element and pivot a pass does a compare, a select and an add (~3 ops; the
nucleus adds an ``expf``, ~10 ops, per element). At [256, 128256] every pass reads the 131 MB
of logits from HBM (~30 us on the H200) and does ~3P + 2 ops per element (P = 7: ~0.75 G ops,
~30 us at ~26 T simple ops/s): memory- and compute-bound alike, so P = 7 (11 passes, ~350 us a
top-k search, ~450 us a top-p one) against 16 at P = 3 and 8 slower ones at P = 15. At batch
1 one program, on one SM, does all the work of a row: 128256 * (3P + 2) ops a pass at ~128
ops/clock (~1.98 GHz): ~12 us at P = 7 (11 passes: ~130 us), ~6 us at P = 3 (16 passes:
~90 us), while the 512 KB row stays in L2. Fewer pivots are cheaper when compute-bound, so
:func:`default_pivots` takes P = 3 below one program per SM. Splitting a row over programs
would need a grid-wide barrier each pass (or a launch per pass): not done; at small batch
this kernel's gain is the launches it saves, at large batch the passes it speeds up.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxinfer.sampling_filters import key_value, order_key, search_passes

NUM_SMS_H200 = 132
BLOCK = 1024  # elements per vector step (a power of two)
UNROLL = 4  # vector steps per loop iteration: the loads in flight per program
NUM_WARPS = 4
_U32 = jnp.uint32
_LO = 0x007FFFFF  # order_key(-inf): the k-th search's lower bound


def default_pivots(rows: int) -> int:
    """Thresholds per pass for ``rows`` programs (module docstring): 3 while the programs
    do not fill the SMs of an H200 (compute-bound per program), else 7."""
    return 3 if rows < NUM_SMS_H200 else 7


def _pivots(lo: jax.Array, hi: jax.Array, P: int) -> list[jax.Array]:
    """P uint32 pivots in (lo, hi], as ``sampling_filters._largest_passing`` spreads them."""
    width = hi - lo
    step = width // _U32(P + 1) + _U32(1)
    return [lo + jnp.minimum(_U32(j) * step, width) for j in range(1, P + 1)]


def _narrow(lo, hi, piv: Sequence[jax.Array], ok: Sequence[jax.Array]):
    """New bracket: lo to the largest passing pivot, hi below the smallest failing one."""
    new_lo, new_hi = lo, hi
    for p, o in zip(piv, ok):
        new_lo = jnp.maximum(new_lo, jnp.where(o, p, lo))
        new_hi = jnp.minimum(new_hi, jnp.where(o, hi, p - _U32(1)))
    return new_lo, jnp.maximum(new_hi, new_lo)


def _sweep(x_ref, row, *, V: int, N: int, U: int, ts: Sequence[jax.Array],
           top: jax.Array | None = None, above: jax.Array | None = None) -> list[jax.Array]:
    """One pass over row ``row`` of ``x_ref`` [S, V]: for each threshold t of ``ts`` the
    count (``top`` None, int32) or the mass ``sum exp(x - top)`` (float32) of x >= t; with
    ``above``, two more: the count and the mass of x > above."""
    n_iter = pl.cdiv(V, N * U)
    masked = V % (N * U) != 0
    lanes = jnp.arange(N, dtype=jnp.int32)
    ninf = jnp.float32(-jnp.inf)

    def load(i):  # U blocks of N elements: iteration i's
        out = []
        for u in range(U):
            idx = (i * U + u) * N + lanes
            out.append(plgpu.load(x_ref.at[row, idx], mask=idx < V, other=ninf) if masked
                       else plgpu.load(x_ref.at[row, idx]))
        return tuple(out)

    def add(accs, xs):
        accs = list(accs)
        for x in xs:
            if top is None:
                one = jnp.ones((N,), jnp.int32)
                accs[:len(ts)] = [a + jnp.where(x >= t, one, 0) for a, t in zip(accs, ts)]
            else:
                w = jnp.exp(x - top)
                accs[:len(ts)] = [a + jnp.where(x >= t, w, 0.0) for a, t in zip(accs, ts)]
            if above is not None:
                gt = x > above
                accs[-2] = accs[-2] + jnp.where(gt, jnp.ones((N,), jnp.int32), 0)
                accs[-1] = accs[-1] + jnp.where(gt, w, 0.0)
        return tuple(accs)

    def body(i, carry):
        accs, xs = carry
        nxt = load(jnp.minimum(i + 1, n_iter - 1))  # issued before this iteration's compares
        return add(accs, xs), nxt

    dt = jnp.int32 if top is None else jnp.float32
    zeros = [jnp.zeros((N,), dt) for _ in ts]
    if above is not None:
        zeros += [jnp.zeros((N,), jnp.int32), jnp.zeros((N,), jnp.float32)]
    accs, _ = jax.lax.fori_loop(0, n_iter, body, (tuple(zeros), load(0)))
    return [jnp.sum(a) for a in accs]


def _search(lo, hi, P: int, passes: int, measure: Callable, ok: Callable) -> jax.Array:
    """Largest key in [lo, hi] whose measure passes (lo taken to pass), at most ``passes``
    passes of P pivots; stops when the bracket is one key."""
    def cond(c):
        i, lo, hi = c
        return (i < passes) & (lo < hi)

    def body(c):
        i, lo, hi = c
        piv = _pivots(lo, hi, P)
        m = measure([key_value(p) for p in piv])
        lo, hi = _narrow(lo, hi, piv, [ok(v) for v in m])
        return i + 1, lo, hi

    return jax.lax.while_loop(cond, body, (jnp.int32(0), lo, hi))[1]


def _kth_kernel(hi_ref, k_ref, x_ref, o_ref, *, V: int, P: int, N: int, U: int) -> None:
    row = pl.program_id(0)
    k, hi = k_ref[row], hi_ref[row]
    lo = jnp.where(k <= 1, hi, _U32(_LO))  # k <= 1: the maximum itself, no pass
    sweep = functools.partial(_sweep, x_ref, row, V=V, N=N, U=U)
    o_ref[row] = _search(lo, hi, P, search_passes(P), lambda ts: sweep(ts=ts),
                         lambda c: c >= k)


def _nucleus_kernel(top_ref, hi_ref, kth_ref, lo_ref, k_ref, p_ref, x_ref, o_ref, *, V: int,
                    P: int, N: int, U: int) -> None:
    row = pl.program_id(0)
    top, kth, k, p, lo = top_ref[row], kth_ref[row], k_ref[row], p_ref[row], lo_ref[row]
    hi = jnp.where(p >= 1.0, lo, hi_ref[row])  # top_p 1 keeps the top-k: the cut is kth
    sweep = functools.partial(_sweep, x_ref, row, V=V, N=N, U=U, top=top)

    def first():  # the first pass also measures the top-k's mass (x > kth, plus its ties)
        piv = _pivots(lo, hi, P)
        *m, n_above, mass_above = sweep(ts=[key_value(q) for q in piv], above=kth)
        ties = k - n_above
        w_kth = jnp.where(ties > 0, jnp.exp(kth - top), 0.0)
        target = p * (mass_above + ties.astype(jnp.float32) * w_kth)
        return (*_narrow(lo, hi, piv, [v >= target for v in m]), target)

    def closed():  # no pass: the target is not used (a traced value: Triton's scf.yield
        return lo, hi, p  # takes no literal)

    lo, hi, target = jax.lax.cond(lo < hi, first, closed)
    o_ref[row] = _search(lo, hi, P, search_passes(P) - 1, lambda ts: sweep(ts=ts),
                         lambda v: v >= target)


def _check(name: str, x: jax.Array, **rows: jax.Array) -> None:
    if x.ndim != 2 or x.dtype != jnp.float32:
        raise ValueError(f"{name}: x must be [S, V] float32, got {x.shape} {x.dtype}")
    S, V = x.shape
    if V < 1 or S * V >= 2 ** 31:
        raise ValueError(f"{name}: needs 1 <= V and S * V < 2^31 (int32 offsets), got {x.shape}")
    for arg, a in rows.items():
        if a.shape != (S,):
            raise ValueError(f"{name}: {arg} must be [{S}], got {a.shape}")


def _call(kernel, name: str, args: list[jax.Array], *, interpret: bool, num_warps: int,
          num_stages: int) -> jax.Array:
    S = args[-1].shape[0]
    spec = pl.BlockSpec(memory_space=pl.ANY)
    key = pl.pallas_call(
        kernel, grid=(S,), out_shape=jax.ShapeDtypeStruct((S,), _U32),
        in_specs=[spec] * len(args), out_specs=spec, interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name=name)(*args)
    return key_value(key)


def kth_largest(x: jax.Array, top: jax.Array, k: jax.Array, *, pivots: int | None = None,
                block: int = BLOCK, unroll: int = UNROLL, num_warps: int = NUM_WARPS,
                num_stages: int = 1, interpret: bool = False) -> jax.Array:
    """[S] float32 k-th largest value of each row (ties counted): ``sampling_filters.
    kth_largest`` in one launch, the same value bit for bit.

    Args:
      x: [S, V] float32 without NaN.  top: [S] float32 the row maxima.
      k: [S] int32 in [1, V] (k <= 1 gives ``top``; k > V gives -inf, as the jnp search).
      pivots: thresholds per pass (default :func:`default_pivots` of S).
      block / unroll / num_warps / num_stages: vector step (a power of two), steps per loop
        iteration, Triton launch parameters.  interpret: Pallas interpreter (CPU tests).
    Raises:
      ValueError: shapes or dtypes other than above, or S * V >= 2^31.
    """
    _check("kth_largest", x, top=top, k=k)
    S, V = x.shape
    P = pivots or default_pivots(S)
    kernel = functools.partial(_kth_kernel, V=V, P=P, N=block, U=unroll)
    return _call(kernel, f"kth_search_p{P}", [order_key(top), k.astype(jnp.int32), x],
                 interpret=interpret, num_warps=num_warps, num_stages=num_stages)


def nucleus_cut(x: jax.Array, top: jax.Array, kth: jax.Array, k: jax.Array, top_p: jax.Array,
                *, pivots: int | None = None, block: int = BLOCK, unroll: int = UNROLL,
                num_warps: int = NUM_WARPS, num_stages: int = 1,
                interpret: bool = False) -> jax.Array:
    """[S] smallest value that top-p keeps within the top-k of each row:
    ``sampling_filters.nucleus_cut`` in one launch (masses summed in another order: the
    module docstring says what may differ).

    Args:
      x: [S, V] float32 without NaN.  top: [S] row maxima.  kth: [S] the k-th largest value
        (-inf when top-k is off).  k: [S] int32 top-k in [1, V] (V when off).
      top_p: [S] float32 in (0, 1]; >= 1 keeps the whole top-k (the cut is ``kth``, no pass).
      pivots, block, unroll, num_warps, num_stages, interpret: as :func:`kth_largest`.
    Raises:
      ValueError: shapes or dtypes other than above, or S * V >= 2^31.
    """
    _check("nucleus_cut", x, top=top, kth=kth, k=k, top_p=top_p)
    S, V = x.shape
    P = pivots or default_pivots(S)
    f32 = jnp.float32
    kernel = functools.partial(_nucleus_kernel, V=V, P=P, N=block, U=unroll)
    args = [top.astype(f32), order_key(top), kth.astype(f32), order_key(kth),
            k.astype(jnp.int32), top_p.astype(f32), x]
    return _call(kernel, f"nucleus_search_p{P}", args, interpret=interpret,
                 num_warps=num_warps, num_stages=num_stages)
