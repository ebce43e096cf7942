"""Exact top-k / top-p threshold search as a Pallas GPU kernel (Triton lowering).

The jnp reference is :mod:`jaxinfer.sampling_filters` (``kth_largest``, ``nucleus_cut``); its
module docstring explains the method: the k-th largest value is the largest threshold t with
``count(x >= t) >= k``, the top-p cut the largest t >= kth with
``mass(x >= t) >= top_p * mass(top k)``, found by narrowing a bracket in the order-preserving
uint32 image of float32 (``order_key``) by ``P + 1`` per pass, P thresholds compared per pass
(the pivot search of FlashInfer's sorting-free sampling, ``top_k_mask_logits`` /
``top_p_renorm_probs``, and of vLLM's Qrita kernels). XLA runs each pass as a few kernels: a
variadic P-output row reduction (far from memory-bound on the H200: ~120 us a pass at
[256, 128256] f32 against ~30 us for one read of the logits) and the bracket updates, so that
at batch 1 a search is ~50 small launches. Here:

* one-launch mode (``split=False``): one program per row runs every pass. The bracket stays in
  registers; a ``lax.while_loop`` runs at most ``search_passes(P)`` passes and stops once
  lo == hi (rows with k <= 1 or top_p >= 1 start closed: no pass);
* split mode (``split=True``, the default below ``SPLIT_ROWS`` rows): a row's segments go to
  programs of their own, one launch per pass; each launch first sums the previous pass's
  per-segment measures (in segment order), narrows the bracket, then measures its segment at
  the new pivots. ``search_passes(P) + 1`` launches, no XLA op in between (the middle ones
  in a ``lax.fori_loop`` of known trip count, which XLA:GPU runs without a host sync);
* a pass walks segments of ``segment`` elements in steps of ``block``, ``unroll`` steps per loop
  iteration, the next iteration's loads issued before this one's compares (register
  prefetch). Each threshold keeps a [block] accumulator (int32 counts, or float32 masses
  ``exp(x - top)``), summed at the end of each segment; the row's measure is the segment sums
  added in segment order, in both modes, so a row's result is the same in either mode, at any
  S, with any P. The tail past V is masked (-inf: no threshold reaches it, its mass is 0);
* compaction (the nucleus search, ``COMPACT`` > 0, the default): the passes also count the
  elements at or above each pivot, so the bracket's population is known after each pass; once
  it is at most ``COMPACT`` the row's bracket elements are copied, in row order, to a scratch
  buffer and the remaining passes read only the copy, measuring ``mass(x > hi)`` (from the last
  pass over the row) plus the copy's masses. A pass over the row costs a read of V floats, a
  pass over the copy a few thousand from L2: N(0, 3.75^2) rows of 128256 copy after 1-2 passes
  instead of ~9. The compacting kernel runs one program per row at every batch size, 7 pivots
  (the copied sums depend on the bracket's steps, so neither may change with the batch); the
  split mode stays for ``compact=0``;
* pivots, bracket updates and the final key are the jnp search's ops on scalars (both visit the
  same brackets); the nucleus search measures ``mass(top k)`` (count and mass of x > kth) in
  its first pass instead of a pass of its own.

Results. ``kth_largest``: the jnp search's float32 value, bit for bit (counts are exact).
``nucleus_cut``: masses are summed in another order than XLA's and ``exp`` is CUDA's ``expf``,
so where ``top_p * mass(top k)`` lies within float32 rounding of a prefix mass the two may cut
one value apart -- the jnp search's own tolerance against a sorted cumulative sum
(tests/core/test_sampling_filters.py). The kernel's masses are a monotone function of the
threshold (one summation order for every threshold; rounding to nearest is monotone), so the
largest passing key does not depend on which pivots visit it. Inputs with subnormal floats may
differ where a backend flushes them (XLA:CPU compares them as 0).

Cost model (estimates, not measurements; benchmarks/kernels/bench_sampling_search.py measures).
A pass costs a compare, a select and an add per element and threshold (~3P + 2 ops; the
nucleus adds an ``expf``, ~10), plus P tree sums per segment. [256, 128256]: each pass reads
131 MB from HBM (~30 us) and does ~0.75 G ops at P = 7 (~30 us at ~26 T simple ops/s):
P = 7, 11 passes, ~350-500 us a search (jnp: ~1,350 us top-p). Batch 1 in one launch: one SM
does the row, ~128256 (3P + 2) ops a pass at ~128 ops a clock: ~6 us at P = 3, 16 passes
~100-160 us, no better than jnp; split into 8 segments of 16384 (8 SMs): ~1.5-2 us of work a
launch plus the launch, ~12 launches at P = 7: ~50-70 us. The segment length trades the
one-launch mode's tree sums (P per 16384 elements, ~15 % at P = 7) against split parallelism.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxinfer.order_keys import key_value, order_key
from jaxinfer.sampling_filters import search_passes
from pallas_kernels.sampling.search_steps import (
    LO,
    NPARAM,
    U32,
    copy_bracket,
    copy_measure,
    geometry,
    narrow,
    narrow_tracked,
    nucleus_target,
    pivot_keys,
    search_loop,
    start_bracket,
    sweep,
)

NUM_SMS_H200 = 132
BLOCK = 1024  # elements per vector step (a power of two)
UNROLL = 4  # vector steps per loop iteration: the loads in flight per program
SEGMENT = 16384  # elements per segment: the unit of summation order and of split programs
SPLIT_ROWS = 64  # split=None splits rows over programs below this many rows
NUM_WARPS = 4
# nucleus_cut: a row's search continues on a compacted copy of its bracket once the bracket
# holds at most this many elements (0: never; then rows below SPLIT_ROWS take the split mode).
# H200 (session 8, bench_nucleus_compact.py, S = 256, V = 128256, logit std 3.75, top_p 0.9):
# full passes 514 us; capacity 2048 / 4096 / 8192 298 / 275 / 235 us (4 warps, block 1024;
# 8 warps or block 512 slower at S = 256); at S = 1 one program per row takes 138 us.
COMPACT = 8192
_U32 = U32
_LO = LO  # order_key(-inf): the k-th search's lower bound (tests read it here)


def default_pivots(rows: int, split: bool = False, compact: int = 0) -> int:
    """Thresholds per pass (module docstring): 7 when split, compacting (the pivot count must
    not depend on the batch: the compacted phase's sums depend on the bracket's steps) or when
    the rows fill the SMs of an H200, else 3 (one program per row, compute-bound: fewer ops per
    element)."""
    return 7 if split or compact or rows >= NUM_SMS_H200 else 3


def _row_kernel(*refs, kind: str, P: int, g: dict) -> None:
    """One-launch mode: program ``row`` runs every pass of its row."""
    *param_refs, x_ref, o_ref = refs
    row = pl.program_id(0)
    lo, hi, v = start_bracket(kind, [r[row] for r in param_refs])
    passes = search_passes(P)
    measure_row = functools.partial(sweep, x_ref, row, 0, g["n_seg"], g=g, top=v.get("top"))
    if kind == "kth":
        o_ref[row] = search_loop(lo, hi, P, passes, lambda ts: measure_row(ts=ts),
                                 lambda c: c >= v["k"])
        return

    def first():  # the first pass also measures the top-k's mass
        piv = pivot_keys(lo, hi, P)
        *m, n_above, mass_above = measure_row(ts=[key_value(q) for q in piv], above=v["kth"])
        target = nucleus_target(v, n_above, mass_above)
        return (*narrow(lo, hi, piv, [x >= target for x in m]), target)

    def closed():  # no pass; the target is unused (traced: Triton's scf.yield takes no literal)
        return lo, hi, v["p"]

    lo, hi, target = jax.lax.cond(lo < hi, first, closed)
    o_ref[row] = search_loop(lo, hi, P, passes - 1, lambda ts: measure_row(ts=ts),
                             lambda m: m >= target)


def _compact_kernel(*refs, P: int, g: dict, capacity: int, barrier: bool) -> None:
    """One-launch nucleus search that finishes on a compacted copy of its bracket: the passes
    over the row also count x >= pivot, so the number of elements inside the bracket is known
    after each; once it is at most ``capacity`` they are copied (in row order) to ``buf_ref``
    and the remaining passes read only that copy, measuring ``mass(x > hi) + mass(copy >= t)``
    (``search_steps.copy_measure``). The bracket steps are the full search's, so the pass
    count is bounded as before; every row, alone or in any batch, takes the same steps. ``barrier``:
    a CTA barrier between the copy and its reads (False in the interpreter, which has none and
    runs a program's lanes in order)."""
    *param_refs, x_ref, o_ref, stats_ref, buf_ref = refs
    row = pl.program_id(0)
    lo, hi, v = start_bracket("nucleus", [r[row] for r in param_refs])
    top_key = param_refs[1][row]  # order_key(top): the bracket's upper end before any pass
    passes = search_passes(P)
    measure_row = functools.partial(sweep, x_ref, row, 0, g["n_seg"], g=g, top=v["top"],
                                    counts=True)
    zero = v["k"] - v["k"]  # traced zeros: Triton's scf.yield takes no literal
    st0 = (zero + g["V"], zero, zero.astype(jnp.float32))

    def first():  # the first pass also measures the top-k's mass
        piv = pivot_keys(lo, hi, P)
        r = measure_row(ts=[key_value(q) for q in piv], above=v["kth"])
        target = nucleus_target(v, r[-2], r[-1])
        return (*narrow_tracked(lo, hi, piv, [x >= target for x in r[:P]], r[:P],
                                 r[P:2 * P], st0), target)

    def closed():  # no pass; the target is unused (traced: Triton's scf.yield takes no literal)
        return lo, hi, st0, v["p"]

    lo, hi, st, target = jax.lax.cond(lo < hi, first, closed)
    i0 = jnp.where(lo < hi, jnp.int32(1), jnp.int32(0))

    def wide(c):  # another pass over the row while the bracket holds too many elements
        i, lo, hi, st = c
        return (i < passes) & (lo < hi) & (st[0] - st[1] > capacity)

    def full_pass(c):
        i, lo, hi, st = c
        piv = pivot_keys(lo, hi, P)
        r = measure_row(ts=[key_value(q) for q in piv])
        return (i + 1, *narrow_tracked(lo, hi, piv, [x >= target for x in r[:P]], r[:P],
                                        r[P:], st))

    i, lo, hi, st = jax.lax.while_loop(wide, full_pass, (i0, lo, hi, st))

    def finish():
        bounded = hi != top_key  # a pivot failed: hi + 1 is the smallest failing one
        pop = copy_bracket(x_ref, buf_ref, row, key_value(lo), key_value(hi + U32(1)), bounded,
                           g=g, capacity=capacity)
        if barrier:
            plgpu.debug_barrier()  # the copy's stores before any thread's loads
        return search_loop(lo, hi, P, passes - i, lambda ts: copy_measure(
            buf_ref, row, pop, ts, v["top"], st[2], g=g), lambda m: m >= target), pop

    o_ref[row], copied = jax.lax.cond(lo < hi, finish, lambda: (lo, i - i - 1))
    stats_ref[row, 0] = i
    stats_ref[row, 1] = copied


def _split_kernel(*refs, kind: str, P: int, g: dict, phase: str, after_first: bool) -> None:
    """Split mode, one launch per pass: program (row, s) narrows the row's bracket from the
    previous launch's per-segment measures (``phase`` "mid" / "last"), then measures segment s
    at the new pivots (``phase`` "first" / "mid"); "last" writes the row's key."""
    it = iter(refs)
    row, s = pl.program_id(0), pl.program_id(1)
    lo, hi, v = start_bracket(kind, [next(it)[row] for _ in range(NPARAM[kind])])
    tbits = lo - lo  # the nucleus target's bits, set after the first pass (traced zero)
    if phase != "first":
        state_ref, part_ref = next(it), next(it)
        lo, hi, tbits = state_ref[row, 0], state_ref[row, 1], state_ref[row, 2]
        target = jax.lax.bitcast_convert_type(tbits, jnp.float32)
        m = [part_ref[row, 0, j] for j in range(part_ref.shape[2])]
        for t in range(1, g["n_seg"]):  # segment order: the one-launch mode's sum
            m = [a + part_ref[row, t, j] for j, a in enumerate(m)]
        if kind == "nucleus" and after_first:
            target = nucleus_target(v, m[P].astype(jnp.int32), m[P + 1])
            tbits = jax.lax.bitcast_convert_type(target, _U32)
        ok = [c >= v["k"] for c in m[:P]] if kind == "kth" else [x >= target for x in m[:P]]
        lo, hi = narrow(lo, hi, pivot_keys(lo, hi, P), ok)
    if phase == "last":
        next(it)[row] = lo
        return
    x_ref, state_out, part_out = it
    above = v["kth"] if kind == "nucleus" and phase == "first" else None
    ts = [key_value(q) for q in pivot_keys(lo, hi, P)]
    dt = part_out.dtype
    n = P + (0 if above is None else 2)
    zero = (lo - lo).astype(dt)  # traced: Triton's scf.yield takes no literal
    m = jax.lax.cond(lo < hi, lambda: tuple(c.astype(dt) for c in sweep(
        x_ref, row, s, 1, g=g, ts=ts, top=v.get("top"), above=above)), lambda: (zero,) * n)
    for j, c in enumerate(m):
        part_out[row, s, j] = c

    @pl.when(s == 0)
    def _():
        state_out[row, 0] = lo
        state_out[row, 1] = hi
        state_out[row, 2] = tbits


def _search_call(kind: str, name: str, params: list[jax.Array], x: jax.Array, *,
                 pivots: int | None, split: bool | None, block: int, unroll: int,
                 segment: int, num_warps: int, num_stages: int, interpret: bool,
                 compact: int = 0, return_stats: bool = False) -> Any:
    if x.ndim != 2 or x.dtype != jnp.float32:
        raise ValueError(f"{name}: x must be [S, V] float32, got {x.shape} {x.dtype}")
    S, V = x.shape
    if V < 1 or S * V >= 2 ** 31:
        raise ValueError(f"{name}: needs 1 <= V and S * V < 2^31 (int32 offsets), got {x.shape}")
    for i, a in enumerate(params):
        if a.shape != (S,):
            raise ValueError(f"{name}: row operand {i} must be [{S}], got {a.shape}")
    g = geometry(V, block, unroll, segment)
    if compact < 0 or (compact and split) or (return_stats and not compact):
        raise ValueError(f"{name}: compact {compact} must be >= 0, 0 in split mode and > 0 "
                         f"for return_stats")
    if split is None:
        split = not compact and S < SPLIT_ROWS and g["n_seg"] > 1
    P = pivots or default_pivots(S, split, compact)
    spec = pl.BlockSpec(memory_space=pl.ANY)
    cp = plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    call = functools.partial(pl.pallas_call, interpret=interpret, compiler_params=cp)
    keys = jax.ShapeDtypeStruct((S,), _U32)
    if compact:  # the copy is a scratch output, [S, compact + 1] (the dump slot last)
        kernel = functools.partial(_compact_kernel, P=P, g=g, capacity=compact,
                                   barrier=not interpret)
        key, stats, _ = call(kernel, grid=(S,), out_shape=[
            keys, jax.ShapeDtypeStruct((S, 2), jnp.int32),
            jax.ShapeDtypeStruct((S, compact + 1), jnp.float32)],
            in_specs=[spec] * (len(params) + 1), out_specs=[spec] * 3,
            name=f"{name}_c{compact}_p{P}_v{V}")(*params, x)
        return (key_value(key), stats) if return_stats else key_value(key)
    if not split:
        kernel = functools.partial(_row_kernel, kind=kind, P=P, g=g)
        key = call(kernel, grid=(S,), out_shape=keys, in_specs=[spec] * (len(params) + 1),
                   out_specs=spec, name=f"{name}_p{P}_v{V}")(*params, x)
        return key_value(key)
    M = P + (2 if kind == "nucleus" else 0)
    dt = jnp.int32 if kind == "kth" else jnp.float32
    carry = [jax.ShapeDtypeStruct((S, 3), _U32), jax.ShapeDtypeStruct((S, g["n_seg"], M), dt)]
    passes = search_passes(P)

    def launch(phase: str, state: list[jax.Array], after_first: bool = False) -> list:
        kernel = functools.partial(_split_kernel, kind=kind, P=P, g=g, phase=phase,
                                   after_first=after_first)
        last = phase == "last"
        args = [*params, *state] + ([] if last else [x])
        return call(kernel, grid=(S, 1 if last else g["n_seg"]),
                    out_shape=[keys] if last else carry, in_specs=[spec] * len(args),
                    out_specs=[spec] * (1 if last else 2),
                    name=f"{name}_split_p{P}_v{V}_{phase}{'1' if after_first else ''}")(*args)

    # Launch i narrows by pass i - 1 and measures pass i: first, passes - 1 mids (the first of
    # them computes the nucleus target; the rest in a loop of known trip count, which XLA:GPU
    # runs without a host sync), last.
    state = launch("first", [])
    state = launch("mid", state, after_first=True)
    state = jax.lax.fori_loop(0, passes - 2, lambda _, st: launch("mid", list(st)), state)
    return key_value(launch("last", list(state))[0])


def kth_largest(x: jax.Array, top: jax.Array, k: jax.Array, *, pivots: int | None = None,
                split: bool | None = None, block: int = BLOCK, unroll: int = UNROLL,
                segment: int = SEGMENT, num_warps: int = NUM_WARPS, num_stages: int = 1,
                interpret: bool = False) -> jax.Array:
    """[S] float32 k-th largest value of each row (ties counted): ``sampling_filters.
    kth_largest``, the same value bit for bit. Method: pivot bracketing of the order keys
    (FlashInfer's sorting-free top-k; module docstring).

    Args:
      x: [S, V] float32 without NaN.  top: [S] float32 the row maxima.
      k: [S] int32 in [1, V] (k <= 1 gives ``top``; k > V gives -inf, as the jnp search).
      pivots: thresholds per pass (default :func:`default_pivots`).
      split: rows split over programs, one launch per pass (None: below ``SPLIT_ROWS`` rows
        when a row has more than one segment), else one launch, one program per row.
      block / unroll / segment: vector step (a power of two), steps per loop iteration,
        elements per segment (a multiple of block * unroll; it fixes the summation order).
      num_warps / num_stages: Triton launch parameters.  interpret: Pallas interpreter (CPU).
    Raises:
      ValueError: x not [S, V] float32, V < 1, S * V >= 2^31, top / k not [S], or a bad
        geometry (block not a power of two, segment not a multiple of block * unroll).
    """
    return _search_call("kth", "kth_search", [order_key(top), k.astype(jnp.int32)], x,
                        pivots=pivots, split=split, block=block, unroll=unroll,
                        segment=segment, num_warps=num_warps, num_stages=num_stages,
                        interpret=interpret)


def nucleus_cut(x: jax.Array, top: jax.Array, kth: jax.Array, k: jax.Array, top_p: jax.Array,
                *, pivots: int | None = None, split: bool | None = None, block: int = BLOCK,
                unroll: int = UNROLL, segment: int = SEGMENT, num_warps: int = NUM_WARPS,
                num_stages: int = 1, interpret: bool = False,
                lo: jax.Array | None = None, compact: int | None = None,
                return_stats: bool = False) -> Any:
    """[S] float32 smallest value that top-p keeps within the top-k of each row:
    ``sampling_filters.nucleus_cut`` (masses summed in another order: module docstring).
    Method: pivot bracketing of the order keys (FlashInfer's sorting-free top-p; module
    docstring).

    Args:
      x: [S, V] float32 without NaN.  top: [S] float32 row maxima.  kth: [S] float32 the
        k-th largest value (-inf when top-k is off).  k: [S] int32 top-k in [1, V] (V: off).
      top_p: [S] float32 in (0, 1]; >= 1 keeps the whole top-k (the cut is ``kth``, no pass).
      pivots, split, block, unroll, segment, num_warps, num_stages, interpret: as
        :func:`kth_largest`.
      lo: [S] float32 start of the search bracket (default ``kth``): a value the caller knows
        to pass (``mass(x >= lo) >= top_p * mass(top k)``), equal to ``kth`` where top_p >= 1;
        the cut is the same, reached in fewer passes (``sampling_filters.nucleus_floor``).
      compact: finish each row on a copy of its bracket once it holds at most this many
        elements (:func:`_compact_kernel`; default ``COMPACT``; 0: every pass reads the row).
        Compacting rules out the split mode (``split`` must not be True) and fixes the pivot
        count at 7 whatever the batch, so a row's cut does not depend on its batch.
      return_stats: (compacting only) return (cut, stats [S, 2] int32): per row the passes
        over the whole row and the elements copied (-1: the bracket closed without a copy).
    Raises:
      ValueError: as :func:`kth_largest` (row operands [S]), or ``compact`` < 0, ``compact``
        with ``split=True``, ``return_stats`` with ``compact=0``.
    """
    f32 = jnp.float32
    params = [top.astype(f32), order_key(top), kth.astype(f32),
              order_key(kth if lo is None else lo),
              k.astype(jnp.int32), top_p.astype(f32)]
    return _search_call("nucleus", "nucleus_search", params, x, pivots=pivots, split=split,
                        block=block, unroll=unroll, segment=segment, num_warps=num_warps,
                        num_stages=num_stages, interpret=interpret,
                        compact=COMPACT if compact is None else compact,
                        return_stats=return_stats)
