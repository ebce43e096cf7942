"""Paged prefill / chunked-prefill attention as a Pallas GPU kernel (Triton lowering).

FlashAttention-2 style (Dao 2023): one program handles one (query block, KV head). A query
block is ``BQ = block_m // G`` consecutive packed tokens times the ``G = Hq / Hkv`` q heads
that share the KV head, flattened to ``block_m`` rows (row ``r`` is token ``r // G``, head
``r % G``): every K/V tile is loaded once for the whole group (GQA), and a block's causal
span is only ``BQ`` positions wide. The program walks its sequence's KV tokens ``block_k``
at a time through the block table, straight from the stacked cache ``[L, Hkv, P, ps, D]``
at ``layer`` (gather loads, as in decode.py), with an online softmax in base 2 and f32
accumulators.

Ragged packing: a query block may hold tokens of several sequences and padding (seq_id -1).
Small XLA ops before the ``pallas_call`` (:func:`block_metadata`) list each block's distinct
sequences and, per (block, sequence), the KV token range its rows can see (causal, sliding
window, sequence length) and the KV blocks that every row of the block sees in full. The
kernel loops over the block's sequences (usually one); per sequence it runs the KV blocks at
the ragged edges with masks (row's sequence, causal, window, length; masked K/V slots are not
read) and the interior ones with no mask at all. A block holding several sequences is
correct but does the tile work once per sequence, so a runner that packs each sequence's
tokens contiguously (as ours does) pays this only at the sequence boundaries.

FP8 (e4m3fn) caches are widened in registers (to f16 by default); ``k_scale`` folds into
the softmax scale and ``v_scale`` into the output.
Design notes, SASS analysis and measurements: benchmarks/kernels/NOTES_paged_prefill.md.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.paged_attention.decode_options import KV_DTYPES, LOG2E, _pow2
from pallas_kernels.paged_attention.errors import (
    PagedAttentionShapeError,
    PagedAttentionUnsupportedError,
    check_q_and_cache,
    scalar_operands,
)

_BIG = 2**30


def _cdiv(a, b):
    return (a + b - 1) // b


def block_metadata(positions: jax.Array, seq_ids: jax.Array, seq_lens: jax.Array,
                   window: jax.Array | int, *, bq: int, block_k: int,
                   max_seqs: int) -> tuple[jax.Array, jax.Array]:
    """Per query block of ``bq`` tokens: its distinct sequences and their KV ranges.

    Returns:
      nseq: [nblk] int32 number of distinct sequences (seq_id >= 0) in each block.
      meta: [nblk, J, 5] int32, J = min(bq, max_seqs); for j < nseq[b]: (seq id s,
        lo_tok, hi_tok, fb_lo, fb_hi). KV tokens [lo_tok, hi_tok) are the ones some row of
        block b in sequence s may see (causal, window, < seq_lens[s]); KV blocks
        [fb_lo, fb_hi) (units of ``block_k`` tokens) are seen in full by every row of the
        block, which holds no other sequence (else the range is empty, fb_lo == fb_hi).
    """
    T = positions.shape[0]
    nblk = _cdiv(T, bq)
    pad = nblk * bq - T
    sid = jnp.pad(seq_ids, (0, pad), constant_values=-1).reshape(nblk, bq)
    pos = jnp.pad(positions, (0, pad)).reshape(nblk, bq)
    srt = jnp.sort(sid, axis=1)
    first = (srt >= 0) & jnp.concatenate(
        [jnp.ones((nblk, 1), bool), srt[:, 1:] != srt[:, :-1]], axis=1)
    nseq = first.sum(axis=1).astype(jnp.int32)
    J = min(bq, max_seqs)
    seqs = jnp.sort(jnp.where(first, srt, _BIG), axis=1)[:, :J]  # distinct ids first
    seqs = jnp.where(seqs == _BIG, 0, seqs)
    member = (sid[:, None, :] == seqs[:, :, None])  # [nblk, J, bq]
    member &= (jnp.arange(J) < nseq[:, None])[:, :, None]
    p = pos[:, None, :]
    minpos = jnp.where(member, p, _BIG).min(axis=2)
    maxpos = jnp.where(member, p, -1).max(axis=2)
    slen = seq_lens[seqs]
    window = jnp.asarray(window, jnp.int32)
    has_w = window > 0
    lo_tok = jnp.where(has_w, jnp.maximum(minpos - window + 1, 0), 0)
    hi_tok = jnp.minimum(maxpos + 1, slen)
    f_lo = jnp.where(has_w, jnp.maximum(maxpos - window + 1, 0), 0)
    f_hi = jnp.minimum(minpos + 1, slen)
    kb_lo, kb_hi = lo_tok // block_k, _cdiv(hi_tok, block_k)
    fb_lo, fb_hi = _cdiv(f_lo, block_k), f_hi // block_k
    full = (nseq == 1)[:, None] & (fb_lo < fb_hi)
    fb_lo = jnp.where(full, jnp.clip(fb_lo, kb_lo, kb_hi), kb_hi)
    fb_hi = jnp.where(full, jnp.clip(fb_hi, fb_lo, kb_hi), kb_hi)
    meta = jnp.stack([seqs, lo_tok, hi_tok, fb_lo, fb_hi], axis=-1).astype(jnp.int32)
    return nseq, meta


def _prefill_kernel(*refs, G: int, Hkv: int, BQ: int, BM: int, BK: int, ps: int, D: int,
                    T: int, nblk: int, scale_log2: float, static_window: int | None,
                    has_kscale: bool, has_vscale: bool, compute_dtype, reverse: bool) -> None:
    it = iter(refs)
    layer_ref = next(it)
    window_ref = next(it) if static_window is None else None
    ks_ref = next(it) if has_kscale else None
    vs_ref = next(it) if has_vscale else None
    nseq_ref, meta_ref, bt_ref, pos_ref, sid_ref, q_ref, k_ref, v_ref, o_ref = (
        next(it) for _ in range(9))

    # One flat grid axis, KV heads fastest: each wave runs the same query blocks of all KV
    # heads; with ``reverse`` the last (longest causal) blocks go first, so the short ones
    # fill the tail of the last wave (longest-processing-time-first scheduling).
    pid = pl.program_id(0)
    i, h = pid // Hkv, pid % Hkv
    if reverse:
        i = nblk - 1 - i
    layer = layer_ref[0]
    window = window_ref[0] if window_ref is not None else int(static_window or 0)

    r = jnp.arange(BM, dtype=jnp.int32)
    tq = r // G  # token of each row within the block
    rvalid = (tq < BQ) & (i * BQ + tq < T)
    tok = jnp.where(rvalid, i * BQ + tq, 0)
    # Store rows: on the GPU masked lanes store nothing, so invalid rows may alias token 0.
    # The interpreter emulates a masked store as read-modify-write of every row, where
    # aliased rows race; there the output has spare rows (T_out > T) and no row aliases.
    T_out = o_ref.shape[0]
    tok_st = tok if T_out == T else jnp.where(tq < BQ, i * BQ + tq, T_out - 1)
    qhead = h * G + r % G
    col = jnp.arange(D, dtype=jnp.int32)
    c = jnp.arange(BK, dtype=jnp.int32)

    pos_r = plgpu.load(pos_ref.at[tok], mask=rvalid, other=0)
    sid_r = plgpu.load(sid_ref.at[tok], mask=rvalid, other=-1)
    q = plgpu.load(q_ref.at[tok[:, None], qhead[:, None], col[None, :]], mask=rvalid[:, None],
                   other=jnp.zeros((), q_ref.dtype))
    if compute_dtype == jnp.float16 and q.dtype != jnp.float16:
        q = jnp.clip(q.astype(jnp.float32), -65504.0, 65504.0)
    q = q.astype(compute_dtype)
    sm = scale_log2 * (ks_ref[0] if ks_ref is not None else 1.0)
    zero = jnp.zeros((), k_ref.dtype)

    def seq_body(j, carry):
        s = meta_ref[i, j, 0]
        lo_tok, hi_tok = meta_ref[i, j, 1], meta_ref[i, j, 2]
        fb_lo, fb_hi = meta_ref[i, j, 3], meta_ref[i, j, 4]
        rmatch = sid_r == s

        def step(kb, carry, masked: bool):
            acc, m, l = carry
            kpos = kb * BK + c  # [BK] absolute KV positions of this tile
            if masked:
                kvalid = (kpos >= lo_tok) & (kpos < hi_tok)
                page = plgpu.load(bt_ref.at[s, kpos // ps], mask=kvalid, other=0)
            else:
                page = plgpu.load(bt_ref.at[s, kpos // ps])
            idx = (layer, h, page[:, None], (kpos % ps)[:, None], col[None, :])
            if masked:
                k = plgpu.load(k_ref.at[idx], mask=kvalid[:, None], other=zero)
                v = plgpu.load(v_ref.at[idx], mask=kvalid[:, None], other=zero)
            else:
                k = plgpu.load(k_ref.at[idx])
                v = plgpu.load(v_ref.at[idx])
            k, v = k.astype(compute_dtype), v.astype(compute_dtype)
            sc = plgpu.dot(q, k, trans_b=True, allow_tf32=False)  # [BM, BK] f32, unscaled
            if masked:
                ok = rmatch[:, None] & kvalid[None, :] & (kpos[None, :] <= pos_r[:, None])
                if static_window is None or static_window > 0:
                    ok &= (window <= 0) | (pos_r[:, None] - kpos[None, :] < window)
                sc = jnp.where(ok, sc, -jnp.inf)
            # sm > 0, so the row max of the scaled scores is the scaled row max, and the
            # scale folds into the exponent's FMA (FlashAttention-2's Triton kernel does this).
            m_new = jnp.maximum(m, sc.max(axis=1) * sm)  # log2 units
            # A row with no visible key yet keeps m = -inf; subtract 0 so p = 0, not NaN.
            m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new) if masked else m_new
            alpha = jnp.exp2(m - m_use)
            p = jnp.exp2(sc * sm - m_use[:, None])
            l = l * alpha + p.sum(axis=1)
            acc = acc * alpha[:, None] + plgpu.dot(p.astype(compute_dtype), v,
                                                   allow_tf32=False)
            return acc, m_new, l

        masked_step = functools.partial(step, masked=True)
        carry = jax.lax.fori_loop(lo_tok // BK, fb_lo, masked_step, carry)
        carry = jax.lax.fori_loop(fb_lo, fb_hi, functools.partial(step, masked=False), carry)
        return jax.lax.fori_loop(fb_hi, _cdiv(hi_tok, BK), masked_step, carry)

    acc0 = jnp.zeros((BM, D), jnp.float32)
    m0 = jnp.full((BM,), -jnp.inf, jnp.float32)
    l0 = jnp.zeros((BM,), jnp.float32)
    acc, _, l = jax.lax.fori_loop(0, nseq_ref[i], seq_body, (acc0, m0, l0))

    has = (l > 0) & (sid_r >= 0)
    o = jnp.where(has[:, None], acc / jnp.where(has, l, 1.0)[:, None], 0.0)
    if vs_ref is not None:
        o = o * vs_ref[0]
    plgpu.store(o_ref.at[tok_st[:, None], qhead[:, None], col[None, :]],
                o.astype(o_ref.dtype), mask=rvalid[:, None])


def default_tuning(head_dim: int, kv_dtype) -> dict[str, int]:
    """Tile sizes and launch parameters: block_m query rows x block_k KV tokens per step.

    Chosen from the SASS of the kernel compiled for sm_90 with Triton 3.6 on a CPU machine
    (see the notes): 8 warps (two warpgroups sharing the K/V tiles, so one's softmax can
    overlap the other's wgmma), 5 stages (the block-table load is pipeline stage 0, so this
    is what gives three K/V buffers and real prefetch), and tiles that keep the accumulator
    and the uncombined second dot's result in registers without spills.
    """
    del kv_dtype
    if head_dim <= 64:
        return {"block_m": 128, "block_k": 128, "num_warps": 8, "num_stages": 5}
    if head_dim <= 128:
        return {"block_m": 128, "block_k": 64, "num_warps": 8, "num_stages": 5}
    return {"block_m": 64, "block_k": 32, "num_warps": 8, "num_stages": 5}


def _check(q, k_cache, v_cache, block_tables, seq_lens, positions, seq_ids) -> None:
    name = "paged_prefill_attention"
    check_q_and_cache(name, q, k_cache, v_cache)
    T = q.shape[0]
    if positions.shape != (T,) or seq_ids.shape != (T,):
        raise PagedAttentionShapeError(
            f"{name}: positions{positions.shape} / seq_ids{seq_ids.shape} must be [{T}]")
    if block_tables.ndim != 2 or seq_lens.shape != (block_tables.shape[0],):
        raise PagedAttentionShapeError(
            f"{name}: block_tables{block_tables.shape} / seq_lens{seq_lens.shape} "
            f"must be [S, maxp] / [S]")
    for a, n in ((block_tables, "block_tables"), (seq_lens, "seq_lens"),
                 (positions, "positions"), (seq_ids, "seq_ids")):
        if a.dtype != jnp.int32:
            raise PagedAttentionShapeError(f"{name}: {n} must be int32, got {a.dtype}")


def _kernel_accepts(q_shape: tuple[int, ...], k_cache_shape: tuple[int, ...], kv_dtype,
                    block_m: int = 128) -> bool:
    if len(q_shape) != 3 or len(k_cache_shape) != 5:
        return False
    _, Hq, D = q_shape
    _, Hkv, _, ps, Dk = k_cache_shape
    if D != Dk or Hkv <= 0 or Hq % Hkv or Hq // Hkv > block_m:
        return False
    if not (_pow2(D) and 16 <= D <= 256 and _pow2(ps)):
        return False
    return jnp.dtype(kv_dtype) in [jnp.dtype(d) for d in KV_DTYPES]


def paged_prefill_attention_supported(q_shape: tuple[int, ...],
                                      k_cache_shape: tuple[int, ...], kv_dtype) -> bool:
    """Whether the engine should dispatch these shapes/dtypes to the kernel (else the ref).

    Needs a power-of-two head dim (16..256) and page size (tokens), Hq a multiple of Hkv with
    at most 64 q heads per KV head, and a bf16 / f16 / float8_e4m3fn cache (f32 runs, for
    tests, but is not tuned for the GPU). q [T, Hq, D], k_cache [L, Hkv, P, ps, D]; other
    ranks give False (no exception).
    """
    return (_kernel_accepts(q_shape, k_cache_shape, kv_dtype, block_m=64)
            and jnp.dtype(kv_dtype) != jnp.dtype(jnp.float32))


def paged_prefill_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                            layer: jax.Array | int, block_tables: jax.Array,
                            seq_lens: jax.Array, positions: jax.Array, seq_ids: jax.Array,
                            *, scale: float, window: jax.Array | int = 0,
                            k_scale: jax.Array | float | None = None,
                            v_scale: jax.Array | float | None = None, interpret: bool = False,
                            block_m: int | None = None, block_k: int | None = None,
                            num_warps: int | None = None, num_stages: int | None = None,
                            reverse: bool = True,
                            fp8_compute_dtype=jnp.float16) -> jax.Array:
    """Packed ragged causal attention (prefill / chunked prefill) over a paged KV cache.

    Same contract as :func:`reference.paged_prefill_attention_ref`: the new tokens' K/V are
    already in the cache, each query attends to its sequence's KV positions ``<=`` its own
    (and within the sliding window), read through the block table. Method: FlashAttention-2
    (Dao 2023) over vLLM's paged KV layout, with ragged packing (module docstring).

    Args:
      q: [T, Hq, D] bf16/f16/f32 packed queries of several sequences.
      k_cache, v_cache: [L, Hkv, P, ps, D] bf16/f16/f32 or float8_e4m3fn (with scales).
      layer: int32 scalar (may be traced, e.g. inside a scan over layers).
      block_tables: [S, maxp] int32 page ids. seq_lens: [S] int32 context length in tokens
        after this step (``maxp * ps`` at most).
      positions: [T] int32 absolute position of each token (``< seq_lens[seq]``).
      seq_ids: [T] int32 row of each token in block_tables; -1 for padding tokens.
      scale: softmax scale, > 0. window: sliding window in tokens, 0 = none (int or traced).
      k_scale, v_scale: FP8 dequantisation scales (read = stored * scale; > 0), or None.
      interpret: run the Pallas interpreter (CPU tests).
      block_m: query rows per program (tokens x q heads of one KV head), a power of two
        >= 16 and >= Hq / Hkv. block_k: KV tokens per inner step, a power of two >= 16.
        num_warps / num_stages: Triton launch / pipelining parameters. None:
        :func:`default_tuning`.
      reverse: launch the last (longest causal) query blocks first (load balance).
      fp8_compute_dtype: dtype FP8 K/V are widened to for the dots (f16: fewer instructions
        than bf16 from e4m3, as in decode.py; q is clipped to the f16 range).
    Returns:
      [T, Hq, D] in q.dtype; padding tokens give zeros.
    Raises:
      PagedAttentionShapeError: inconsistent shapes or dtypes (the four index arrays int32).
      PagedAttentionUnsupportedError: shapes or tile sizes the kernel does not handle (see
        :func:`paged_prefill_attention_supported` and ``block_m`` / ``block_k``), or scale <= 0.
    """
    _check(q, k_cache, v_cache, block_tables, seq_lens, positions, seq_ids)
    T, Hq, D = q.shape
    _, Hkv, _, ps, _ = k_cache.shape
    tune = default_tuning(D, k_cache.dtype)
    block_m = block_m or tune["block_m"]
    block_k = block_k or tune["block_k"]
    num_warps = num_warps or tune["num_warps"]
    num_stages = num_stages or tune["num_stages"]
    G = Hq // Hkv
    if not scale > 0:
        raise PagedAttentionUnsupportedError(
            f"paged_prefill_attention: scale={scale} must be > 0 (it is folded into the "
            f"exponent after the row max)")
    if not _kernel_accepts(q.shape, k_cache.shape, k_cache.dtype, block_m=block_m):
        raise PagedAttentionUnsupportedError(
            f"paged_prefill_attention: unsupported q{q.shape} k_cache{k_cache.shape} "
            f"{k_cache.dtype} with block_m={block_m}; use paged_prefill_attention_ref")
    if not (_pow2(block_m) and block_m >= 16 and _pow2(block_k) and block_k >= 16):
        raise PagedAttentionUnsupportedError(
            f"paged_prefill_attention: block_m={block_m} and block_k={block_k} must be "
            f"powers of two >= 16")
    BQ = block_m // G
    nblk = _cdiv(T, BQ)
    nseq, meta = block_metadata(positions, seq_ids, seq_lens, window, bq=BQ,
                                block_k=block_k, max_seqs=block_tables.shape[0])

    operands, static_window, compute_dtype = scalar_operands(
        layer, window, k_scale, v_scale, k_cache.dtype, fp8_compute_dtype)
    operands += [nseq, meta, block_tables, positions, seq_ids, q, k_cache, v_cache]
    kernel = functools.partial(
        _prefill_kernel, G=G, Hkv=Hkv, BQ=BQ, BM=block_m, BK=block_k, ps=ps, D=D, T=T,
        nblk=nblk,
        scale_log2=scale * LOG2E, static_window=static_window,
        has_kscale=k_scale is not None, has_vscale=v_scale is not None,
        compute_dtype=compute_dtype, reverse=reverse)
    T_out = nblk * BQ + 1 if interpret else T  # see the store in the kernel
    out = pl.pallas_call(
        kernel, grid=(nblk * Hkv,), out_shape=jax.ShapeDtypeStruct((T_out, Hq, D), q.dtype),
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name=f"paged_prefill_m{block_m}_k{block_k}",
    )(*operands)
    return out if T_out == T else out[:T]
