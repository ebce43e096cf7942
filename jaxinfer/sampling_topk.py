"""Sort-free selection of each row's best values for the on-device sampler: the chunks with the
largest maxima and the top-K logprobs.

XLA:GPU keeps only ``lax.top_k`` with k <= 16 on a dedicated kernel (``TOPK_FAST``; xla
``topk_specializer.cc``: "CustomCall TopK requires k <= 16 and n >= 1024", larger k is
decomposed into sort + slice), and on the H200 at vocab 128k that kernel took ~0.15-0.26 ms
per call at batch 1 and ~0.4-0.65 ms at batch 256 (benchmarks/RESULTS.md). So:

* :func:`top_chunks` gathers each row's n best chunks: chunks of :func:`chunk_size` (64 at
  V = 128256: 2004 chunks, enough for XLA:GPU's TopK kernel) consecutive logits, ranked by
  their maxima. Every element among the n largest lies in them; the buffered cut-offs of
  :func:`jaxinfer.sampling_filters.buffered_cutoffs` (rows with a small top-k) are decided on
  the [S, 64 * 64] buffer of the 64 best;
* the K = 20 best logprobs come from :func:`top_values`: the 20 best chunks in row order, then
  two ``lax.top_k`` of at most 16 over their 1280 elements (or one sort of them:
  ``SELECT_METHOD``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.order_keys import order_key

TOPK_FAST = 16  # XLA:GPU's TopK kernel takes k <= 16 (n >= 1024); larger k is a sort there
TOPK_STAGED = 4 * TOPK_FAST  # top_values finds up to this many best in TOPK_FAST-sized stages
# Tunables, read at trace time (benchmarks/sampling_cost.py sweeps them). CHUNK: elements per
# chunk; CHUNKED_TOP_VALUES: top_values looks only at its best K chunks.
CHUNK = 64  # at most; halved until a row has TOPK_MIN_N chunks (chunk_size)
TOPK_MIN_N = 1024  # XLA:GPU's TopK kernel needs rows of >= 1024 elements (else a sort)
CHUNKED_TOP_VALUES = True
# How top_chunks ranks the chunk maxima and top_values the gathered buffer: "topk" (the
# TOPK_FAST-sized lax.top_k stages of staged_top_values: 4 TopK kernels for 64 chunks, 2 + 2
# for the top-20 logprobs; H200 session 6 found such stages slow at batch 1: ~55 us a stage
# over [1, 4096]) or "sort" (one lax.sort per selection: the [S, C] maxima with their chunk
# ids, the [S, K * chunk] logprobs buffer with its token ids). Same chunks kept (for
# the cut-offs any choice of the n best is exact) and the same top-K ids and values, ties to
# the lower index, except that "sort" ranks -FLT_MAX above -inf where the stages tie them.
# H200 (session 7, RESULTS.md "Sampling cost"), with DRAW_METHOD "hash" and NUCLEUS_FLOOR:
# top_k + top_p B=1 236 -> 70 us, everything at once B=1 340 -> 105 us, B=256 721 -> 472 us.
SELECT_METHOD = "sort"
SELECT_METHODS = ("topk", "sort")
NEG_INF = -jnp.inf


def chunk_size(V: int) -> int:
    """Chunk length for rows of V: CHUNK, halved until there are TOPK_MIN_N chunks (the TopK
    over the chunk maxima stays on XLA:GPU's TopK kernel) or it is 1."""
    c = CHUNK
    while c > 1 and -(-V // c) < TOPK_MIN_N:
        c //= 2
    return c


def _chunked(x: jax.Array, chunk: int) -> jax.Array:
    """[S, V] -> [S, C, chunk], C = ceil(V / chunk), the tail padded with -inf."""
    S, V = x.shape
    C = -(-V // chunk)
    if C * chunk != V:
        x = jnp.pad(x, ((0, 0), (0, C * chunk - V)), constant_values=NEG_INF)
    return x.reshape(S, C, chunk)


def top_chunks(x: jax.Array, n: int, chunk: int | None = None,
               ascending: bool = False) -> tuple[jax.Array, jax.Array]:
    """The ``n`` chunks of each row with the largest maxima, gathered.

    Chunks are ``chunk`` consecutive elements (default ``chunk_size(V)``; the tail is padded
    with -inf). Ranked by their maxima as :func:`top_values` ranks values, ties to the lower chunk.
    Any element among the k largest of its row (k <= n; ties to the lower index, as
    ``lax.top_k``) lies in these chunks, and every element larger than the k-th largest chunk
    maximum too: a chunk left out has n chunks ranked above it, each with a maximum at least
    as large (and earlier on a tie). All chunks when there are at most ``n``.

    Args:
      x: [S, V] float32 without NaN.  n: int >= 1.
      ascending: order the chunks by position (else by rank) -- positions in the buffer then
        keep the order of positions in the row.
    Returns:
      buffer [S, n' * chunk] float32, chunk ids [S, n'] int32 (n' = min(n, C)).
    """
    c = chunk_size(x.shape[1]) if chunk is None else chunk
    xc = _chunked(x, c)
    S, C, _ = xc.shape
    if n >= C:
        return xc.reshape(S, C * c), jnp.broadcast_to(jnp.arange(C, dtype=jnp.int32), (S, C))
    if SELECT_METHOD not in SELECT_METHODS:
        raise ValueError(f"SELECT_METHOD {SELECT_METHOD!r}: one of {SELECT_METHODS}")
    maxima = jnp.max(xc, axis=-1)  # [S, C]
    if SELECT_METHOD == "sort":
        ids = sorted_best(maxima, jnp.broadcast_to(jnp.arange(C, dtype=jnp.int32), (S, C)), n)
    else:
        _, ids = staged_top_values(maxima, n)  # [S, C] -> [S, n]
    if ascending:  # rank of each id among the row's ids -> its slot (n x n compares)
        rank = jnp.sum(ids[:, None, :] < ids[:, :, None], axis=-1)  # [S, n]
        ids = jnp.sum(jnp.where(rank[:, :, None] == jnp.arange(n)[None, None, :],
                                ids[:, :, None], 0), axis=1)
    buf = jnp.take_along_axis(xc, ids[:, :, None], axis=1)  # [S, n, c]
    return buf.reshape(S, n * c), ids.astype(jnp.int32)


def top_values(x: jax.Array, K: int) -> tuple[jax.Array, jax.Array]:
    """``lax.top_k(x, K)`` without a sort on XLA:GPU for K <= TOPK_STAGED.

    With ``CHUNKED_TOP_VALUES``, the K best chunks (:func:`top_chunks`, kept in row order) are
    gathered first and only that buffer (K * chunk_size(V) elements) is ranked: one pass over
    the row (the chunk maxima) instead of one per TOPK_FAST stage; same values, indices and tie
    order as below (the K best, ties to the lower index, all lie in those chunks).
    """
    S, V = x.shape
    c = chunk_size(V)
    if (not CHUNKED_TOP_VALUES or K > TOPK_STAGED or -(-V // c) <= K
            or K * c < TOPK_MIN_N):  # the buffer's TopK would be a sort on XLA:GPU
        return staged_top_values(x, K)
    if SELECT_METHOD == "sort":  # one sort of the buffer by (value, token id)
        buf, ids = top_chunks(x, K, c)
        tok = (ids[:, :, None] * c + jnp.arange(c, dtype=jnp.int32)).reshape(S, K * c)
        idx = sorted_best(buf, tok, K)
        return jnp.take_along_axis(x, idx, axis=-1), idx
    buf, ids = top_chunks(x, K, c, ascending=True)
    _, pos = staged_top_values(buf, K)  # positions in the buffer, in row order
    idx = jnp.take_along_axis(ids, pos // c, axis=-1) * c + pos % c
    return jnp.take_along_axis(x, idx, axis=-1), idx


def sorted_best(x: jax.Array, ids: jax.Array, n: int) -> jax.Array:
    """[S, n] int32 ``ids`` of the n largest values of each row of ``x``, best first, ties to
    the lower id: one ``lax.sort`` by (descending order key, ascending id) (SELECT_METHOD
    "sort"). -0.0 ties with +0.0; -inf ranks below -FLT_MAX.

    Args:
      x: [S, N] float32 without NaN.  ids: [S, N] int32, distinct within a row.  n <= N.
    """
    _, out = jax.lax.sort((~order_key(x), ids), dimension=1, num_keys=2)
    return out[:, :n]


def staged_top_values(x: jax.Array, K: int) -> tuple[jax.Array, jax.Array]:
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
