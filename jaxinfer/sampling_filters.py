"""Sort-free exact top-k / top-p cut-offs and top-K logprobs for the on-device sampler.

A full sort of the vocabulary is what made sampling expensive at large batch: on XLA:GPU
``jnp.sort`` of [256, 128256] float32 and ``lax.top_k`` with k > 16 (a sort there too) take
milliseconds. XLA:GPU keeps only ``lax.top_k`` with k <= 16 on a dedicated kernel
(``TOPK_FAST``; xla ``topk_specializer.cc``: "CustomCall TopK requires k <= 16 and n >= 1024",
larger k is decomposed into sort + slice), and on the H200 at vocab 128k that kernel took
~0.15-0.26 ms per call at batch 1 and ~0.4-0.65 ms at batch 256 (benchmarks/RESULTS.md). So:

* every filtering row finds its cut-offs by a threshold search over values instead of a sort
  (the idea of FlashInfer's sorting-free ``top_k_mask_logits`` / ``top_p_renorm_probs`` pivot
  search and of vLLM's Qrita top-k/top-p kernels): the k-th largest value is the largest
  threshold t with ``count(x >= t) >= k``; the top-p cut is the largest present value t with
  ``mass(x >= t) >= top_p * mass(top-k)``. Each pass of the search compares every element
  with ``PIVOTS`` thresholds at once (one fused reduction over the vocabulary) and narrows a
  bracket in the order-preserving integer image of float32 by a factor ``PIVOTS + 1``; after
  ``SEARCH_PASSES`` passes the bracket is one value. The threshold found is exactly the one
  the rule defines (no tolerance, no iteration cap), for any input: ties, -inf, +-0;
* the K = 20 best logprobs come from :func:`top_values` (two ``lax.top_k`` of at most 16).

Semantics are those of the sort-based cut they replace (vLLM v1's order: top-k, then top-p
over the renormalised top-k; ties at a cut-off are kept, as in vLLM's threshold masking; the
best token always survives). The only difference is where float32 rounding enters: masses are
summed as reductions rather than as a cumulative sum over sorted values.

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

TOPK_FAST = 16  # XLA:GPU's TopK kernel takes k <= 16 (n >= 1024); larger k is a sort there
TOPK_STAGED = 4 * TOPK_FAST  # top_values finds up to this many best in TOPK_FAST-sized stages
PIVOTS = 15  # thresholds compared per pass; the bracket shrinks by PIVOTS + 1 per pass
SEARCH_PASSES = 8  # ceil(32 / log2(PIVOTS + 1)): a 2^32-wide bracket down to one value
NEG_INF = -jnp.inf
_U32 = jnp.uint32


def order_key(x: jax.Array) -> jax.Array:
    """float32 -> uint32 with ``a < b  <=>  key(a) < key(b)`` for non-NaN floats (-0.0 -> +0.0)."""
    x = jnp.where(x == 0, jnp.zeros_like(x), x)
    b = jax.lax.bitcast_convert_type(x, _U32)
    return jnp.where((b >> 31) == 1, ~b, b | _U32(0x80000000))


def key_value(k: jax.Array) -> jax.Array:
    """Inverse of :func:`order_key`: uint32 key -> float32 (anything equal to 0 -> +0.0).

    A backend that treats subnormals as zero (XLA:CPU) lets a search end on a subnormal key
    that compares equal to 0; it comes back as 0.
    """
    b = jnp.where((k >> 31) == 1, k & _U32(0x7FFFFFFF), ~k)
    v = jax.lax.bitcast_convert_type(b, jnp.float32)
    return jnp.where(v == 0, jnp.zeros_like(v), v)


def _row_sums(rows: list[jax.Array], stack: bool = True) -> Any:
    """Row sums of several [S, V] arrays as one variadic reduction: one pass over the row
    (one kernel on XLA:GPU) however many sums. Returns [S, len(rows)] or a list of [S]."""
    zeros = [jnp.zeros((), r.dtype) for r in rows]
    sums = jax.lax.reduce(rows, zeros, lambda a, b: [u + v for u, v in zip(a, b)], (1,))
    return jnp.stack(sums, axis=1) if stack else sums


def _largest_passing(lo: jax.Array, hi: jax.Array, passes: Callable[[Any], Any],
                     measure: Callable[[jax.Array], Any]) -> jax.Array:
    """[S] largest key t in [lo, hi] with ``passes(measure(key_value(t)))``.

    ``measure(thresholds [S, P] float32) -> [S, P]`` is one fused pass over the rows and must
    be non-increasing in the threshold; ``passes -> bool [S, P]``. Key ``lo`` is taken to pass.
    Keys in [lo, hi] must map to non-NaN floats.
    """
    steps = jnp.arange(1, PIVOTS + 1, dtype=_U32)[None, :]

    def body(_, bracket):
        lo, hi = bracket
        width = hi - lo
        step = width // (PIVOTS + 1) + 1
        piv = lo[:, None] + jnp.minimum(steps * step[:, None], width[:, None])
        ok = passes(measure(key_value(piv)))
        new_lo = jnp.max(jnp.where(ok, piv, lo[:, None]), axis=1)
        new_hi = jnp.min(jnp.where(ok, hi[:, None], piv - 1), axis=1)
        return new_lo, jnp.maximum(new_hi, new_lo)

    return jax.lax.fori_loop(0, SEARCH_PASSES, body, (lo, hi))[0]


def kth_largest(x: jax.Array, top: jax.Array, k: jax.Array) -> jax.Array:
    """[S] float32 value of the k-th largest element of each row of ``x`` (ties counted).

    Args:
      x: [S, V] float32 without NaN.  top: [S] the row maxima.  k: [S] int32 in [1, V].
    """
    def count_at_least(t: jax.Array) -> jax.Array:  # t [S, P] -> [S, P] int32
        return _row_sums([(x >= t[:, j, None]).astype(jnp.int32) for j in range(PIVOTS)])

    lo = jnp.full(k.shape, order_key(jnp.float32(NEG_INF)), _U32)
    key = _largest_passing(lo, order_key(top), lambda c: c >= k[:, None], count_at_least)
    return key_value(key)


def nucleus_cut(x: jax.Array, top: jax.Array, kth: jax.Array, k: jax.Array,
                top_p: jax.Array) -> jax.Array:
    """[S] smallest value that top-p keeps within the top-k of each row.

    Follows the sorted-prefix rule: walking down the row sorted in descending order, the
    positions inside the top k whose preceding probability mass (renormalised over the top k)
    is below ``top_p`` are kept; the cut is the value of the last kept position. In values: the
    largest present t >= kth with ``mass(x >= t) >= top_p * mass(top k)``.

    Args:
      x: [S, V] float32 without NaN.  top: [S] row maxima.  kth: [S] the k-th largest value
        (-inf when top-k is off).  k: [S] int32 top-k in [1, V] (V when off).
      top_p: [S] float32 in (0, 1]; 1 keeps the whole top-k (the cut is ``kth``).
    """
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
        return _row_sums([jnp.where(x >= t[:, j, None], w, 0.0) for j in range(PIVOTS)])

    key = _largest_passing(order_key(kth), order_key(top), lambda m: m >= target[:, None],
                           mass_at_least)
    return key_value(key)


def top_values(x: jax.Array, K: int) -> tuple[jax.Array, jax.Array]:
    """``lax.top_k(x, K)`` without a sort on XLA:GPU for K <= TOPK_STAGED.

    The TOPK_FAST best, then the TOPK_FAST best of the rest, and so on: values in descending
    order, among equal values the lower index first, -inf included. Unlike ``lax.top_k``, whose
    total order ranks +0.0 above -0.0 (and -FLT_MAX above -inf), -0.0 ties with +0.0 (and -inf
    with -FLT_MAX). Each stage after the first costs a pass that writes the row with the
    values taken so far removed. Larger K is ``lax.top_k`` itself.

    Args:
      x: [S, V] float32 without NaN.  K: int <= V.
    Returns:
      values [S, K] float32 (taken from ``x``), indices [S, K] int32.
    """
    if K <= TOPK_FAST or K > TOPK_STAGED:
        return jax.lax.top_k(x, K)
    # Ranked as: -0.0 as +0.0, -inf as the lowest finite float, so that the values taken can
    # be set to -inf below everything left.
    y = jnp.where(x == 0, jnp.zeros_like(x), x)
    y = jnp.where(y == NEG_INF, jnp.finfo(jnp.float32).min, y)
    col = jnp.arange(x.shape[-1])[None, :]
    v, i = jax.lax.top_k(y, TOPK_FAST)
    idx = [i]
    for start in range(TOPK_FAST, K, TOPK_FAST):
        # Remove the stage before: above its last value, and its ties up to its last index.
        # (Reductions, not slices, of the top_k outputs: XLA rewrites top_k into sort + slice
        # and back into its TopK kernel only while the sort's sole users are [0, k) slices.)
        last_v = jnp.min(v, axis=-1, keepdims=True)
        last_i = jnp.max(jnp.where(v == last_v, i, -1), axis=-1, keepdims=True)
        y = jnp.where((y > last_v) | ((y == last_v) & (col <= last_i)), NEG_INF, y)
        v, i = jax.lax.top_k(y, min(TOPK_FAST, K - start))
        idx.append(i)
    top_i = jnp.concatenate(idx, axis=-1)
    return jnp.take_along_axis(x, top_i, axis=-1), top_i
