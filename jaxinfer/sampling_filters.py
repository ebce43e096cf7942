"""Sort-free exact top-k / top-p cut-offs for the on-device sampler.

A full sort of the vocabulary is what made sampling expensive at large batch: on XLA:GPU
``jnp.sort`` of [256, 128256] float32 and ``lax.top_k`` with k > 16 (a sort there too) take
milliseconds (XLA:GPU's TopK kernel takes k <= 16 only: :mod:`jaxinfer.sampling_topk`). So:

* every filtering row finds its cut-offs by a threshold search over values instead of a sort
  (the idea of FlashInfer's sorting-free ``top_k_mask_logits`` / ``top_p_renorm_probs`` pivot
  search and of vLLM's Qrita top-k/top-p kernels): the k-th largest value is the largest
  threshold t with ``count(x >= t) >= k``; the top-p cut is the largest present value t with
  ``mass(x >= t) >= top_p * mass(top-k)``. Each pass of the search compares every element
  with ``PIVOTS`` thresholds at once (one fused reduction over the vocabulary) and narrows a
  bracket in the order-preserving integer image of float32 (:mod:`jaxinfer.order_keys`) by a
  factor ``PIVOTS + 1``; after ``SEARCH_PASSES`` passes the bracket is one value. The
  threshold found is exactly the one the rule defines (no tolerance, no iteration cap), for
  any input: ties, -inf, +-0;
* rows with a small top-k (0 < k <= ``BUFFER_TOP_K`` = 64) search only their top-64 chunks
  (:func:`~jaxinfer.sampling_topk.top_chunks`, :func:`buffered_cutoffs`): chunks of
  :func:`~jaxinfer.sampling_topk.chunk_size` (64 at V = 128256: 2004 chunks, enough for
  XLA:GPU's TopK kernel) consecutive logits, ranked by their maxima. Every element above the
  k-th value lies in the k best chunks (a left-out chunk has k chunks ranked above it, each
  holding an element at least its maximum), so the k-th value and the top-p cut within the
  top-k are decided exactly on a
  [S, 64 * 64] buffer: one pass over the vocabulary (the chunk maxima), 4 TopK stages over the
  [S, V / 64] maxima, a gather, then the searches over 4096 elements per row instead of V.
  Rows without top-k (top-p alone) or with a larger one search the vocabulary (the host flag
  ``SamplerNeeds.full_search`` says whether any row does). ``BUFFER_METHOD`` "sort" decides
  in the buffer by one sort of its [S, 4096] uint32 order keys instead (``"topk"``: its 64
  best by four TopK stages), reading the k-th value and the nucleus off the 64 best values
  (:func:`sorted_cutoffs`): a fixed handful of kernels where the two 8-pass searches launch a
  few kernels per pass (H200, B = 1: 119 kernels, launch-bound); same kept sets.

The top-K logprobs come from :func:`jaxinfer.sampling_topk.top_values` (no search).

Cost model per search at B = 256, V = 128256 float32 (131 MB per read of the logits; H200
~4.3 TB/s, ~30 us a read): a full-vocabulary search is ``search_passes(P)`` passes, each one
read and P compare + add per element. P = 15 (76a6e80): 8 passes, 120 pivot evaluations per
element, measured ~150 us a pass (compute-bound: 15 accumulators). P = 3: 16 passes, 48
evaluations, ~1 read per pass (near memory-bound if 3 pivots fit in a read's time); P = 7:
11 passes, 77 evaluations — the default: on the H200 (session 5) the top-p search at B = 256
took 1,552 / 1,352 / 1,428 us with P = 3 / 7 / 15. The buffered search reads 4 MB
(S * 4096 floats) per pass, 1/31 of the vocabulary, after one 131 MB read for the chunk
maxima; the top-k and top-p searches of a row share that read and that buffer.

Semantics are those of the sort-based cut they replace (vLLM v1's order: top-k, then top-p
over the renormalised top-k; ties at a cut-off are kept, as in vLLM's threshold masking; the
best token always survives). The only difference is where float32 rounding enters: masses are
summed as reductions rather than as a cumulative sum over sorted values.

``SEARCH_IMPL`` picks who runs the threshold searches (:func:`kth_largest`, :func:`nucleus_cut`,
so also the buffered "search" method): the jnp ops below, or the Pallas GPU kernel of
``pallas_kernels/sampling/threshold_search.py`` (Triton lowering), which runs every pass of a
search in one launch, one program per row (the k-th search below 64 rows: a launch per pass,
a row's segments on several programs, no XLA op in between; the nucleus search finishes on a
compacted copy of its bracket, ``threshold_search.COMPACT``: on the H200 the top-p search at
B = 256 took 514 -> 235 us); "auto" takes the kernel on a GPU backend and jnp
elsewhere (CPU: CI, laptops). Both give the same k-th value bit for bit; the nucleus cut may
differ where float32 rounding of the mass sums decides (that module's docstring).

Searches run as ``lax.fori_loop`` with a static trip count: XLA:GPU runs such loops without
reading a predicate back to the host (``WhileThunk`` with a known trip count), unlike
``lax.cond``/data-dependent ``while`` loops, whose ``ConditionalThunk``/``WhileThunk`` copy the
predicate to the host and block on the stream.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxinfer import sampling_topk
from jaxinfer.order_keys import key_value, order_key
from jaxinfer.sampling_topk import staged_top_values, top_chunks

# Tunables, read at trace time (benchmarks/sampling_cost.py sweeps them; the cost model is in
# the module docstring). PIVOTS: thresholds compared per pass of a full-vocabulary search (the
# bracket shrinks by PIVOTS + 1 per pass); BUFFER_PIVOTS: the same for searches over a gathered
# buffer; BUFFER_TOP_K: rows with 0 < top_k <= this search the gathered top-BUFFER_TOP_K chunks
# (sampling_topk.top_chunks) instead of the vocabulary (0: never; then PIVOTS = 15 is the
# method of 76a6e80).
PIVOTS = 7  # H200, B=256 top-p search: 3 / 7 / 15 pivots 1,552 / 1,352 / 1,428 us
BUFFER_PIVOTS = 15
BUFFER_TOP_K = sampling_topk.TOPK_STAGED
# How buffered_cutoffs decides in its [S, BUFFER_TOP_K * chunk] buffer: "search" (the threshold
# search, 2 x search_passes(BUFFER_PIVOTS) sequential passes over the buffer: each a few
# kernels, launch-bound at small batch), "sort" (one sort of the buffer per row, then the k-th
# value and the nucleus read off its BUFFER_TOP_K best values: a fixed handful of kernels) or
# "topk" (the BUFFER_TOP_K best values by TOPK_FAST-sized lax.top_k stages, no sort op).
# Same kept sets (tested); benchmarks/sampling_cost.py --buffer-method sweeps them. H200
# (session 6, RESULTS.md "Sampling cost"), top_k + top_p variant search / sort / topk:
# B=1 325 / 239 / 466 us, B=256 963 / 629 / 989 us -> "sort".
BUFFER_METHOD = "sort"
BUFFER_METHODS = ("search", "sort", "topk")
# NUCLEUS_FLOOR: nucleus_cut starts its bracket at nucleus_floor (a value known to pass) rather
# than at the k-th value: the same cut in fewer passes where the floor is well above kth.
# H200 (session 7): top_p alone B=256 895 -> 849 us, B=1 101 -> 93 us.
NUCLEUS_FLOOR = True
FLOOR_MAX_P = 0.96  # rows with a larger top_p keep kth (margin against float32 sums)
# Who runs kth_largest / nucleus_cut: "jnp" (XLA ops), "pallas" (the Pallas kernel of
# pallas_kernels.sampling; run by the Pallas interpreter off a GPU, for tests) or "auto" (pallas
# on a GPU backend, else jnp). PALLAS_PIVOTS: the kernel's thresholds per pass (None: its
# default_pivots by row count); the ``pivots`` arguments and PIVOTS / BUFFER_PIVOTS are the jnp
# search's. H200 (session 6), the top_p variant (full-vocabulary nucleus search) jnp / pallas:
# B=1 122.6 / 103.4 us, B=256 1,355 / 959 us of device time.
SEARCH_IMPL = "auto"
SEARCH_IMPLS = ("auto", "jnp", "pallas")
PALLAS_PIVOTS: int | None = None
NEG_INF = -jnp.inf
_U32 = jnp.uint32


def search_passes(pivots: int) -> int:
    """Passes that narrow a 2^32-wide bracket to one key, ``pivots`` thresholds per pass."""
    n, width = 0, 1 << 32
    while width > 1:
        width = -(-width // (pivots + 1))
        n += 1
    return n


def search_impl() -> str:
    """``SEARCH_IMPL`` resolved at trace time: "jnp" or "pallas" ("auto": pallas when JAX's
    default backend is a GPU). Raises ValueError for a value not in ``SEARCH_IMPLS``."""
    if SEARCH_IMPL not in SEARCH_IMPLS:
        raise ValueError(f"SEARCH_IMPL {SEARCH_IMPL!r}: one of {SEARCH_IMPLS}")
    if SEARCH_IMPL == "auto":
        return "pallas" if jax.default_backend() == "gpu" else "jnp"
    return SEARCH_IMPL


def _pallas_search() -> tuple[Any, dict[str, Any]]:
    """(the kernel module, its keyword arguments) when :func:`search_impl` is "pallas"."""
    from pallas_kernels.sampling import threshold_search

    return threshold_search, {"pivots": PALLAS_PIVOTS,
                              "interpret": jax.default_backend() != "gpu"}


def _row_sums(rows: list[jax.Array], stack: bool = True) -> Any:
    """Row sums of several [S, V] arrays as one variadic reduction: one pass over the row
    (one kernel on XLA:GPU) however many sums. Returns [S, len(rows)] or a list of [S]."""
    zeros = [jnp.zeros((), r.dtype) for r in rows]
    sums = jax.lax.reduce(rows, zeros, lambda a, b: [u + v for u, v in zip(a, b)], (1,))
    return jnp.stack(sums, axis=1) if stack else sums


def _largest_passing(lo: jax.Array, hi: jax.Array, passes: Callable[[Any], Any],
                     measure: Callable[[jax.Array], Any], pivots: int) -> jax.Array:
    """[S] largest key t in [lo, hi] with ``passes(measure(key_value(t)))``.

    ``measure(thresholds [S, P] float32) -> [S, P]`` is one fused pass over the rows and must
    be non-increasing in the threshold; ``passes -> bool [S, P]``. Key ``lo`` is taken to pass.
    Keys in [lo, hi] must map to non-NaN floats. ``pivots`` = P thresholds per pass,
    ``search_passes(P)`` passes.
    """
    steps = jnp.arange(1, pivots + 1, dtype=_U32)[None, :]

    def body(_, bracket):
        lo, hi = bracket
        width = hi - lo
        step = width // (pivots + 1) + 1
        piv = lo[:, None] + jnp.minimum(steps * step[:, None], width[:, None])
        ok = passes(measure(key_value(piv)))
        new_lo = jnp.max(jnp.where(ok, piv, lo[:, None]), axis=1)
        new_hi = jnp.min(jnp.where(ok, hi[:, None], piv - 1), axis=1)
        return new_lo, jnp.maximum(new_hi, new_lo)

    return jax.lax.fori_loop(0, search_passes(pivots), body, (lo, hi))[0]


def kth_largest(x: jax.Array, top: jax.Array, k: jax.Array,
                pivots: int | None = None) -> jax.Array:
    """[S] float32 value of the k-th largest element of each row of ``x`` (ties counted).

    Args:
      x: [S, V] float32 without NaN.  top: [S] the row maxima.  k: [S] int32 in [1, V]
        (k <= 0 gives ``top``: every threshold passes).
      pivots: thresholds per pass of the jnp search (default ``PIVOTS``).
    """
    if search_impl() == "pallas":
        kernels, kw = _pallas_search()
        return kernels.kth_largest(x, top, k, **kw)
    P = PIVOTS if pivots is None else pivots

    def count_at_least(t: jax.Array) -> jax.Array:  # t [S, P] -> [S, P] int32
        return _row_sums([(x >= t[:, j, None]).astype(jnp.int32) for j in range(P)])

    lo = jnp.full(k.shape, order_key(jnp.float32(NEG_INF)), _U32)
    key = _largest_passing(lo, order_key(top), lambda c: c >= k[:, None], count_at_least, P)
    return key_value(key)


def nucleus_cut(x: jax.Array, top: jax.Array, kth: jax.Array, k: jax.Array,
                top_p: jax.Array, pivots: int | None = None) -> jax.Array:
    """[S] smallest value that top-p keeps within the top-k of each row.

    Follows the sorted-prefix rule: walking down the row sorted in descending order, the
    positions inside the top k whose preceding probability mass (renormalised over the top k)
    is below ``top_p`` are kept; the cut is the value of the last kept position. In values: the
    largest present t >= kth with ``mass(x >= t) >= top_p * mass(top k)``.

    Args:
      x: [S, V] float32 without NaN.  top: [S] row maxima.  kth: [S] the k-th largest value
        (-inf when top-k is off).  k: [S] int32 top-k in [1, V] (V when off).
      top_p: [S] float32 in (0, 1]; 1 keeps the whole top-k (the cut is ``kth``).
      pivots: thresholds per pass of the jnp search (default ``PIVOTS``).
    """
    lo = nucleus_floor(top, kth, k, top_p) if NUCLEUS_FLOOR else kth
    if search_impl() == "pallas":
        kernels, kw = _pallas_search()
        return kernels.nucleus_cut(x, top, kth, k, top_p, lo=lo, **kw)
    P = PIVOTS if pivots is None else pivots
    # Unnormalised probabilities, 1 at the maximum: computed once and read by every pass (a
    # variadic reduction recomputes a shared exp for each of its operands).
    w = jnp.exp(x - top[:, None])
    above = x > kth[:, None]
    n_above, mass_above = _row_sums([above.astype(jnp.int32), jnp.where(above, w, 0.0)],
                                    stack=False)
    ties = k - n_above  # copies of the k-th value inside the top-k (of -inf when it is off)
    w_kth = jnp.where(ties > 0, jnp.exp(kth - top), 0.0)
    mass_k = mass_above + ties.astype(jnp.float32) * w_kth
    target = jnp.where(top_p >= 1.0, jnp.inf, top_p * mass_k)

    def mass_at_least(t: jax.Array) -> jax.Array:  # t [S, P] -> [S, P] float32
        return _row_sums([jnp.where(x >= t[:, j, None], w, 0.0) for j in range(P)])

    key = _largest_passing(order_key(lo), order_key(top), lambda m: m >= target[:, None],
                           mass_at_least, P)
    return key_value(key)


def nucleus_floor(top: jax.Array, kth: jax.Array, k: jax.Array, top_p: jax.Array) -> jax.Array:
    """[S] float32 value at or below each row's top-p cut: ``top + log((1 - top_p) / (2 k))``
    where that is above ``kth`` and top_p <= FLOOR_MAX_P, else ``kth``.

    Why it passes: at most k top-k elements lie below t, each of mass (``exp(x - top)``) below
    ``w(t) = (1 - p) / (2k)``, and mass(top k) >= 1 (the maximum), so
    ``mass(x >= t) >= mass_k - (1 - p) / 2 >= (1 + p) / 2 * mass_k > p * mass_k``, a margin of
    (1 - p) / (2p) >= 2 % over the float32 rounding of the sums. The largest passing value
    (the cut) is then found from this floor as from kth; in the order-key image of float32 the
    bracket [floor, top] is narrower, by 2-3 of 11 passes at 7 pivots when the floor is
    positive (it spans a few binades; a bracket across 0 spans nearly all keys: no gain).

    Args:
      top: [S] row maxima.  kth: [S] k-th largest value (-inf: no top-k).
      k: [S] int32 top-k in [1, V] (V when off).  top_p: [S] float32 in (0, 1].
    """
    t = top + jnp.log((1.0 - top_p) / (2.0 * k.astype(jnp.float32)))
    return jnp.where((top_p <= FLOOR_MAX_P) & (t > kth), t, kth)


def buffered_cutoffs(x: jax.Array, top: jax.Array, k: jax.Array, top_p: jax.Array | None,
                     n: int | None = None) -> tuple[jax.Array, jax.Array]:
    """[S] k-th largest value and [S] top-p cut (as :func:`kth_largest` then
    :func:`nucleus_cut`) for rows with k <= n, searched in the row's top-n chunks only.

    Exact: every element above the k-th largest chunk maximum -- so every element above the
    k-th largest value, which is at least that maximum -- lies in the buffer
    (:func:`~jaxinfer.sampling_topk.top_chunks`), and the buffer has at least k elements at
    least that maximum; so ``count(x >= t) >= k`` and ``mass(x >= t)`` agree with the full
    row's for every t the searches decide on (only the order of the float32 mass sums
    differs). A pass reads n * ``sampling_topk.chunk_size(V)`` elements per row instead of V.

    Args:
      x: [S, V] float32 without NaN.  top: [S] row maxima.  k: [S] int32 in [1, min(n, V)].
      top_p: [S] float32 in (0, 1], or None: no nucleus (the cut is the k-th value).
      n: chunks gathered (default ``BUFFER_TOP_K``).
    """
    n = BUFFER_TOP_K if n is None else n
    buf, _ = top_chunks(x, n)
    if BUFFER_METHOD not in BUFFER_METHODS:
        raise ValueError(f"BUFFER_METHOD {BUFFER_METHOD!r}: one of {BUFFER_METHODS}")
    if BUFFER_METHOD != "search":
        m = min(n, buf.shape[1])  # k <= min(n, V) <= m: the k best values are all it needs
        if BUFFER_METHOD == "sort":  # uint32 keys: a one-compare comparator (XLA:GPU can
            # hand such a sort to CUB; a float sort's comparator orders -0.0 / NaN by hand)
            best = key_value(~jnp.sort(~order_key(buf), axis=-1)[:, :m])
        else:
            best = staged_top_values(buf, m)[0]
        return sorted_cutoffs(best, top, k, top_p)
    kth = kth_largest(buf, top, k, BUFFER_PIVOTS)
    if top_p is None:
        return kth, kth
    return kth, nucleus_cut(buf, top, kth, k, top_p, BUFFER_PIVOTS)


def sorted_cutoffs(best: jax.Array, top: jax.Array, k: jax.Array,
                   top_p: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """[S] k-th largest value and [S] top-p cut from each row's m best values, in descending
    order (ties repeated): what :func:`kth_largest` then :func:`nucleus_cut` give, read off
    a sorted prefix instead of searched (BUFFER_METHOD "sort" / "topk").

    The k-th value is ``best[k - 1]``. With ``c_i`` the mass (``exp(v - top)``) of
    ``best[0..i]``, ``mass(x >= best[i]) >= c_i`` (equal at the last copy of a value), so the
    largest present t with ``mass(x >= t) >= top_p * c_{k-1}`` is ``best[i*]``, i* the first
    position with ``c_i >= top_p * c_{k-1}`` (``k - 1`` when top_p is 1); that is the
    sorted-prefix rule, ties at the cut kept by ``x >= cut``. Only where float32 rounding
    enters differs from the search (masses summed over a sorted prefix here).

    Args:
      best: [S, m] float32, the row's m >= k largest values in descending order.
      top: [S] row maxima.  k: [S] int32 in [1, m].
      top_p: [S] float32 in (0, 1], or None: no nucleus (the cut is the k-th value).
    """
    S, m = best.shape
    best = jnp.where(best == 0, jnp.zeros_like(best), best)  # -0.0 -> +0.0, as key_value
    kth = jnp.take_along_axis(best, (k - 1)[:, None], axis=1)[:, 0]
    if top_p is None:
        return kth, kth
    pos = jnp.arange(m)
    in_k = pos[None, :] < k[:, None]
    w = jnp.where(in_k, jnp.exp(best - top[:, None]), 0.0)
    # Prefix masses as one [S, m, m] masked reduction (m = 64: one small fusion, no scan).
    cum = jnp.sum(jnp.where(pos[None, None, :] <= pos[None, :, None], w[:, None, :], 0.0),
                  axis=-1)
    mass_k = jnp.take_along_axis(cum, (k - 1)[:, None], axis=1)[:, 0]
    target = jnp.where(top_p >= 1.0, jnp.inf, top_p * mass_k)
    first = jnp.sum(in_k & (cum < target[:, None]), axis=1)  # positions before i*
    cut = jnp.take_along_axis(best, jnp.minimum(first, k - 1)[:, None], axis=1)[:, 0]
    return kth, cut
