"""Plain-jnp paged attention: the reference every Pallas kernel is checked against.

KV cache layout (shared by the engine and all kernels)::

    k_cache, v_cache: [L, Hkv, P, ps, D]   L layers, Hkv KV heads, P pages, ps tokens a page

Page 0 is the null page: padding tokens write there and nothing reads it. A sequence's
token at position ``p`` lives in page ``block_table[p // ps]`` at offset ``p % ps``; its
flat *slot* is ``page * ps + offset`` (vLLM's slot mapping).

Kernels take the whole stacked cache plus a ``layer`` index (a traced int32 scalar), so
that inside the engine's ``lax.scan`` over layers no per-layer copy of the cache is made.

Sliding windows follow HF transformers: a query at position ``p`` sees key ``k`` iff
``k <= p`` and ``p - k < window`` (``window == 0`` means no window).

FP8 KV (``float8_e4m3fn`` cache): stored = clip(value / scale, -448, 448) (saturating:
e4m3fn has no infinity, so a plain cast turns larger values into NaN), read = stored *
scale, one scale per K and per V (vLLM's per-tensor ``k_scale`` / ``v_scale``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

NEG_INF = -1e30


def _dequant(x: jax.Array, scale: jax.Array | float | None) -> jax.Array:
    x = x.astype(jnp.float32)
    return x if scale is None else x * scale


# How write_kv_ref scatters: "scatter" -- ``cache.at[layer, :, page, off].set(x)``, JAX's
# default (indices may repeat); "unique" -- the same with ``unique_indices=True`` (only padding
# tokens repeat a slot, all in the null page, which nothing reads; the block manager gives
# every real token its own slot, copy-on-write for forked samples); "rows" -- the cache viewed
# as [L * Hkv * P * ps, D] rows, one row a (token, KV head), ``unique_indices=True`` and
# ``mode="promise_in_bounds"`` ("unique" for a pool of 2**31 rows or more); "auto" -- "rows"
# below KV_WRITE_ROWS_BELOW tokens, else "unique". H200, session 22 (benchmarks/kernels/
# bench_kv_write.py, record kv_write_h200_s22call4-20261204; us a layer's K and V write, 8B
# heads 8 x 128, scatter / unique / rows; every method bit-identical outside the null page):
# 1 token bf16 3.70 / 4.62 / 2.69, FP8 3.63 / 4.06 / 2.68; 64 tokens bf16 6.91 / 2.95 / 3.15,
# FP8 10.01 / 3.19 / 2.98; 256 bf16 8.83 / 5.35 / 5.71, FP8 13.48 / 5.58 / 6.42; a 4096-token
# prefill bf16 72.7 / 13.6 / 13.2, FP8 49.1 / 13.5 / 14.8; Gemma 3 270M (1 x 256) 32 tokens
# bf16 6.01 / 2.66 / 2.75, FP8 9.11 / 2.71 / 2.47. In the 8B decode step (FP8 weights and KV,
# 64 rows, ctx 512; profile_decode) the writes took 650 us a step with "scatter", 211 with
# "unique" (device busy 4.89 -> 4.44 ms). Why the default scatter is slow (likely: XLA:GPU
# guards possibly repeated indices with atomic read-modify-write on 32-bit words that 2- and
# 1-byte elements share) was not read from the emitted code. The Pallas kernel of the same
# stores is kv_write.write_kv_pallas (the engine's GPU backend takes it with
# jaxinfer.layers.pallas_attention.KV_WRITE_KERNEL; not timed yet).
KV_WRITE_METHODS = ("scatter", "unique", "rows", "auto")
KV_WRITE_METHOD = "auto"
KV_WRITE_ROWS_BELOW = 64


def kv_write_method(method: str | None, num_tokens: int, pool_rows: int,
                    num_kv_heads: int = 1) -> str:
    """The concrete method ("scatter", "unique" or "rows") of a write of ``num_tokens`` tokens
    of ``num_kv_heads`` KV heads into a pool of ``pool_rows`` = L * Hkv * P * ps rows;
    ``method`` None means :data:`KV_WRITE_METHOD`. Raises ValueError for a method not in
    :data:`KV_WRITE_METHODS`.

    "rows" becomes "unique" for a pool of 2**31 rows or more (row numbers past int32), and for
    a write of one row (one token of a one-KV-head model: Gemma 3 270M's batch-1 decode):
    XLA:CPU turns a one-row scatter into a dynamic-update-slice that it then duplicates for
    the attention that reads the pool, which copies the whole pool twice a layer (Gemma 3
    270M, 1,024 pages: ~34 ms a layer against ~0.1 ms; tests/kernels/test_kv_write.py)."""
    method = KV_WRITE_METHOD if method is None else method
    if method not in KV_WRITE_METHODS:
        raise ValueError(f"write_kv_ref: method {method!r} is not one of {KV_WRITE_METHODS}")
    if method == "auto":
        method = "rows" if num_tokens < KV_WRITE_ROWS_BELOW else "unique"
    if method == "rows" and (pool_rows >= 2**31 or num_tokens * num_kv_heads == 1):
        method = "unique"
    return method


def quantize_kv(x: jax.Array, scale: jax.Array | float | None, dtype) -> jax.Array:
    """New K or V values as a pool of ``dtype`` stores them: divided by the FP8 ``scale``
    (if any) and, for float8_e4m3fn, saturated to ±448 (a plain cast gives NaN past it).
    ``x`` of any shape and float dtype -> the same shape in ``dtype``; no checks, no errors.
    Plain jnp: the reference's write and the Pallas kernel (kv_write.py) share it."""
    if scale is not None:
        x = x.astype(jnp.float32) / scale
    if dtype == jnp.float8_e4m3fn:
        fmax = float(jnp.finfo(dtype).max)
        x = jnp.clip(x.astype(jnp.float32), -fmax, fmax)
    return x.astype(dtype)


def write_kv_ref(k_cache: jax.Array, v_cache: jax.Array, layer: jax.Array,
                 k_new: jax.Array, v_new: jax.Array, slot_mapping: jax.Array,
                 k_scale: jax.Array | float | None = None,
                 v_scale: jax.Array | float | None = None,
                 method: str | None = None) -> tuple[jax.Array, jax.Array]:
    """Scatter new keys/values into their pages (vLLM's ``reshape_and_cache``, as XLA scatters).

    Args:
      k_cache, v_cache: [L, Hkv, P, ps, D] (bf16/f16/f32, or float8_e4m3fn with scales).
      layer: int32 scalar, which layer to write.
      k_new, v_new: [T, Hkv, D] new keys/values (any float dtype, cast to the cache's).
      slot_mapping: [T] int32 flat slots ``page * ps + offset`` in tokens (padding tokens
        point into null page 0); slots other than the null page's must not repeat. A slot
        outside [0, P * ps) is a caller's bug: "rows" writes it into the null page, the
        other methods drop it (past the end) or wrap it (negative), as JAX indexing does.
      k_scale, v_scale: FP8 scales (stored = clip(value / scale, ±448)), or None.
      method: one of :data:`KV_WRITE_METHODS` (default :data:`KV_WRITE_METHOD`, resolved by
        :func:`kv_write_method`); every method stores the same values outside the null page.
    Returns:
      The updated caches, shapes and dtypes unchanged (in place when the caller donates them).
    Raises:
      ValueError: an unknown ``method``. No shape checks: mismatched shapes fail inside jnp.
    """
    L, Hkv, P, ps, D = k_cache.shape
    method = kv_write_method(method, slot_mapping.shape[0], L * Hkv * P * ps, Hkv)

    def quant(x, scale):
        return quantize_kv(x, scale, k_cache.dtype)

    if method == "rows":
        T = slot_mapping.shape[0]
        # a slot outside [0, P * ps) goes to the null page's slot 0 (the row index must stay
        # in this layer and head: "promise_in_bounds" leaves no check behind it)
        slot = jnp.where((slot_mapping >= 0) & (slot_mapping < P * ps), slot_mapping, 0)
        page, off = slot // ps, slot % ps
        head = jnp.arange(Hkv, dtype=jnp.int32)
        rows = ((layer * Hkv + head[None, :]) * P + page[:, None]) * ps + off[:, None]
        rows = rows.reshape(T * Hkv)

        def put(cache, x):
            flat = cache.reshape(L * Hkv * P * ps, D)
            flat = flat.at[rows].set(x.reshape(T * Hkv, D), unique_indices=True,
                                     mode="promise_in_bounds")
            return flat.reshape(cache.shape)

        return put(k_cache, quant(k_new, k_scale)), put(v_cache, quant(v_new, v_scale))
    page, off = slot_mapping // ps, slot_mapping % ps
    unique = method == "unique"
    # Advanced indices split by a slice put the token axis first: the target is [T, Hkv, D].
    k_cache = k_cache.at[layer, :, page, off].set(quant(k_new, k_scale), unique_indices=unique)
    v_cache = v_cache.at[layer, :, page, off].set(quant(v_new, v_scale), unique_indices=unique)
    return k_cache, v_cache


def _gather_context(cache: jax.Array, layer: jax.Array, block_table: jax.Array) -> jax.Array:
    """[L, Hkv, P, ps, D] x [..., maxp] -> [..., Hkv, maxp*ps, D].

    One gather on the stacked cache (no per-layer slice is materialized).
    """
    g = cache[layer, :, block_table]  # advanced indices split by a slice: [..., maxp, Hkv, ps, D]
    g = jnp.moveaxis(g, -3, -4)  # [..., Hkv, maxp, ps, D]
    return g.reshape(*g.shape[:-3], g.shape[-3] * g.shape[-2], g.shape[-1])


def paged_decode_attention_ref(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                               layer: jax.Array, block_tables: jax.Array, seq_lens: jax.Array,
                               *, scale: float, window: jax.Array | int = 0,
                               k_scale: jax.Array | float | None = None,
                               v_scale: jax.Array | float | None = None) -> jax.Array:
    """One query token per sequence against its paged context (decode).

    Plain softmax attention in float32 over the gathered pages (vLLM's paged KV layout, GQA
    by grouping Hq / Hkv query heads per KV head, HF's sliding window rule).

    Args:
      q: [B, Hq, D] float queries of the newest token of each sequence (position seq_len - 1).
      k_cache, v_cache: [L, Hkv, P, ps, D] float, or float8_e4m3fn with scales.
      layer: int32 scalar.
      block_tables: [B, maxp] int32 page ids (unused entries 0).
      seq_lens: [B] int32 context length in tokens including the newest token; 0 for
        padding rows.
      scale: softmax scale. window: sliding window in tokens (0 = none), int or int32 scalar.
      k_scale, v_scale: FP8 dequantisation scales (read = stored * scale), or None.
    Returns:
      [B, Hq, D] in q.dtype; rows with seq_len 0 are zeros.
    Raises:
      TypeError, ValueError: only from jnp, no checks of its own (a reshape's TypeError when
        Hq is not a multiple of Hkv, an einsum's ValueError when head dims differ).
    """
    B, Hq, D = q.shape
    Hkv = k_cache.shape[1]
    k = _dequant(_gather_context(k_cache, layer, block_tables), k_scale)  # [B, Hkv, C, D]
    v = _dequant(_gather_context(v_cache, layer, block_tables), v_scale)
    qg = q.astype(jnp.float32).reshape(B, Hkv, Hq // Hkv, D)
    s = jnp.einsum("bhgd,bhkd->bhgk", qg, k) * scale
    kpos = jnp.arange(k.shape[2])[None, :]
    qpos = (seq_lens - 1)[:, None]
    mask = kpos <= qpos
    window = jnp.asarray(window)
    mask &= (window <= 0) | (qpos - kpos < window)
    s = jnp.where(mask[:, None, None, :], s, NEG_INF)
    p = jax.nn.softmax(s, axis=-1)
    # Slots the mask leaves out (past the context: the null page, a freed page's stale
    # values; before the window) weigh 0, but 0 * NaN is NaN: zeroed, as the kernels never
    # read them.
    v = jnp.where(mask[:, None, :, None], v, 0.0)
    o = jnp.einsum("bhgk,bhkd->bhgd", p, v).reshape(B, Hq, D)
    o = jnp.where((seq_lens > 0)[:, None, None], o, 0.0)
    return o.astype(q.dtype)


def paged_prefill_attention_ref(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                                layer: jax.Array, block_tables: jax.Array,
                                seq_lens: jax.Array, positions: jax.Array, seq_ids: jax.Array,
                                *, scale: float, window: jax.Array | int = 0,
                                k_scale: jax.Array | float | None = None,
                                v_scale: jax.Array | float | None = None) -> jax.Array:
    """Packed ragged causal attention for prefill / chunked prefill.

    The new tokens' K/V must already be written to the cache (see :func:`write_kv_ref`), so
    each query attends to its sequence's earlier pages (cached prefix or earlier chunks)
    and to the new tokens up to itself, all through the block table.

    Args:
      q: [T, Hq, D] packed queries of several sequences.
      k_cache, v_cache, layer, scale, window, k_scale, v_scale: as
        :func:`paged_decode_attention_ref`.
      block_tables: [S, maxp] int32; seq_lens: [S] int32 context length in tokens after
        this step.
      positions: [T] int32 absolute position (tokens) of each query token.
      seq_ids: [T] int32 row of each token in block_tables; padding tokens have -1.
    Returns:
      [T, Hq, D] in q.dtype; padding tokens give zeros.
    Raises:
      TypeError, ValueError: only from jnp, as :func:`paged_decode_attention_ref`.

    Memory is O(T * Hq * C) per sequence (sequences are scanned one at a time), C being
    maxp * ps: fine as a reference and for CPU, not for speed.
    """
    T, Hq, D = q.shape
    Hkv = k_cache.shape[1]
    G = Hq // Hkv
    qg = q.astype(jnp.float32).reshape(T, Hkv, G, D)
    window = jnp.asarray(window)

    def one_seq(acc, s_idx):
        k = _dequant(_gather_context(k_cache, layer, block_tables[s_idx]), k_scale)  # [Hkv,C,D]
        v = _dequant(_gather_context(v_cache, layer, block_tables[s_idx]), v_scale)
        s = jnp.einsum("thgd,hkd->thgk", qg, k) * scale
        kpos = jnp.arange(k.shape[1])[None, :]
        qpos = positions[:, None]
        mask = (kpos <= qpos) & (kpos < seq_lens[s_idx])
        mask &= (window <= 0) | (qpos - kpos < window)
        mask &= (seq_ids == s_idx)[:, None]
        s = jnp.where(mask[:, None, None, :], s, NEG_INF)
        p = jax.nn.softmax(s, axis=-1)
        # Slots no token of the sequence reads zeroed, as in decode (before the window of
        # its first new token, past its context).
        first = jnp.min(jnp.where(seq_ids == s_idx, positions, jnp.iinfo(jnp.int32).max))
        read = (kpos[0] < seq_lens[s_idx]) & ((window <= 0) | (first - kpos[0] < window))
        v = jnp.where(read[None, :, None], v, 0.0)
        o = jnp.einsum("thgk,hkd->thgd", p, v)
        return jnp.where((seq_ids == s_idx)[:, None, None, None], o, acc), None

    acc0 = jnp.zeros((T, Hkv, G, D), jnp.float32)
    out, _ = jax.lax.scan(one_seq, acc0, jnp.arange(block_tables.shape[0]))
    return out.reshape(T, Hq, D).astype(q.dtype)
