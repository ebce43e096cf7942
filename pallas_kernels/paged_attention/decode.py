"""Paged decode attention as a Pallas GPU kernel (Triton lowering), with split-K.

One program handles one (sequence, KV head, split): it loads the group of ``G = Hq / Hkv``
query heads that share the KV head once (GQA: each K/V byte is read once for the whole
group), walks its range of pages ``block_tokens`` tokens at a time through the block table
(online softmax, FlashAttention-2 style), and either writes the final output (one split)
or an f32 partial output plus its base-2 log-sum-exp, which a small XLA merge combines
exactly (Flash-Decoding, Dao et al. 2023; vLLM's paged_attention_v2 does the same), or
with ``merge="kernel"`` the last-arriving split merges in the same launch (decode_merge.py).

K/V are read straight from the stacked cache ``[L, Hkv, P, ps, D]`` at ``layer`` (a kernel
operand, so no per-layer copy is made) with predicated loads: tokens past the sequence end,
before the sliding window, or in another split are neither read nor able to inject NaNs.
FP8 (e4m3fn) caches are widened to f16 in registers (``cvt``, or by bit placement), or fed
to fp8 MMAs directly (see fp8.py for the variants); ``k_scale`` folds into the softmax scale
and ``v_scale`` into the output.

Shape checks, options and launch heuristics: decode_options.py. Design notes and
measurements: benchmarks/kernels/NOTES_paged_attention.md.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.matmul import fp8_fast_accum
from pallas_kernels.paged_attention import decode_merge
from pallas_kernels.paged_attention.decode_options import (
    LOG2E,
    _check,
    _kernel_accepts,
    _merge_splits,
    _next_pow2,
    _resolve_options,
    launch_grid,
)
from pallas_kernels.paged_attention.errors import PagedAttentionUnsupportedError, scalar_operands
from pallas_kernels.paged_attention.fp8 import (
    F16_FROM_BITS,
    P_SCALE,
    e4m3_bits_to_f16,
    fp8_decode_config,
    quantize_rows_e4m3,
    stage_v,
)


def _decode_kernel(*refs, ps: int, bp: int, pps: int, G: int, Gp: int, D: int,
                   scale_log2: float, static_window: int | None, has_kscale: bool,
                   has_vscale: bool, split_out: bool, compute_dtype, fp8_widen: str = "cvt",
                   fp8_dots: str = "none", layout: str = "qk", v_stage: bool = False,
                   straight: bool = False, split_of=None, interpret: bool = False) -> None:
    it = iter(refs)
    layer_ref = next(it)
    window_ref = next(it) if static_window is None else None
    ks_ref = next(it) if has_kscale else None
    vs_ref = next(it) if has_vscale else None
    bt_ref, len_ref, q_ref, k_ref, v_ref, o_ref = (next(it) for _ in range(6))
    lse_ref = next(it) if split_out else None

    b, h, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    s = s if split_of is None else split_of(s)  # decode_merge's test hook
    layer = layer_ref[0]
    seq_len = len_ref[b]
    window = window_ref[0] if window_ref is not None else static_window
    first_tok = jnp.where(window > 0, jnp.maximum(seq_len - window, 0), 0)
    n_pages = (seq_len + ps - 1) // ps
    start = jnp.maximum(s * pps, first_tok // ps)  # first page (block-table column)
    end = jnp.minimum((s + 1) * pps, n_pages)  # one past the last page of this split
    n_iter = (jnp.maximum(end - start, 0) + bp - 1) // bp
    # Straight-line splits (`unroll`): each step covers a fixed slice of the split's static
    # page range, so the block-table read does not wait for seq_len (one dependent round
    # trip less); steps with no valid token are computed and discarded.

    N = bp * ps
    t = jnp.arange(N, dtype=jnp.int32)
    t_page, t_off = t // ps, t % ps
    row = jnp.arange(Gp, dtype=jnp.int32)
    col = jnp.arange(D, dtype=jnp.int32)
    qrow = h * G + row  # q head of each row
    rmask = row < G
    # q: [Gp, D]; rows past the group are zero (Triton's dot needs M >= 16, N >= 8).
    q = plgpu.load(q_ref.at[b, qrow[:, None], col[None, :]], mask=rmask[:, None],
                   other=jnp.zeros((), q_ref.dtype))
    fp8 = k_ref.dtype == jnp.float8_e4m3fn
    qk8, pv8 = fp8 and fp8_dots != "none", fp8 and fp8_dots == "qk_pv"
    bits = fp8 and fp8_widen == "bits"
    sm = scale_log2 * (ks_ref[0] if ks_ref is not None else 1.0)
    if qk8:  # q8 [Gp, D] e4m3, per-row scale folded into the softmax scale
        q, q_scale = quantize_rows_e4m3(q)
        sm = (sm * q_scale)[:, None]
    else:
        if compute_dtype == jnp.float16 and q.dtype != jnp.float16:
            q = jnp.clip(q.astype(jnp.float32), -65504.0, 65504.0)
        q = q.astype(compute_dtype)
        if bits:  # K widened by bits is K * 2^-8
            sm = sm * F16_FROM_BITS

    def widen(x):
        return e4m3_bits_to_f16(x) if bits else x.astype(compute_dtype)

    def load_kv(i):
        slot = (s * pps if straight else start) + i * bp + t_page  # [N] block-table column
        tok = slot * ps + t_off  # [N] absolute position of each token
        valid = (slot < end) & (tok < seq_len) & (tok >= first_tok)
        in_table = slot < bt_ref.shape[1] if straight else slot < end
        page = plgpu.load(bt_ref.at[b, slot], mask=in_table, other=0)
        idx = (layer, h, page[:, None], t_off[:, None], col[None, :])
        zero = jnp.zeros((), k_ref.dtype)
        k = plgpu.load(k_ref.at[idx], mask=valid[:, None], other=zero)
        v = plgpu.load(v_ref.at[idx], mask=valid[:, None], other=zero)
        return k, v, valid

    def v_operand(v, valid):
        v16 = widen(v)
        return stage_v(v16, valid) if fp8 and v_stage else v16

    def body_qk(i, carry):  # scores [Gp, N]: q rows are the MMA's M side
        acc, m, l = carry
        k, v, valid = load_kv(i)
        if qk8:
            sc = plgpu.dot(q, k, trans_b=True) * sm  # fp8 x fp8 -> f32
        else:
            sc = plgpu.dot(q, widen(k), trans_b=True, allow_tf32=False) * sm
        # sc: [Gp, N] f32, log2 units
        sc = jnp.where(valid[None, :], sc, -jnp.inf)
        m_new = jnp.maximum(m, sc.max(axis=1))  # finite: every block has a valid token
        alpha = jnp.exp2(m - m_new)
        p = jnp.exp2(sc - m_new[:, None])
        l = l * alpha + p.sum(axis=1)
        if pv8:  # P * 2^8 in e4m3 against fp8 V
            pv = plgpu.dot((p * P_SCALE).astype(k_ref.dtype), v)
        else:
            pv = plgpu.dot(p.astype(compute_dtype), v_operand(v, valid), allow_tf32=False)
        acc = acc * alpha[:, None] + pv
        return acc, m_new, l

    fast = None
    if layout == "kq" and qk8 and not interpret:
        fp8_fast_accum.install()
        fast = fp8_fast_accum.FAST_ACCUM

    def body_kq(i, carry):  # transposed: scores [N, Gp], acc = O^T [D, Gp]
        acc, m, l = carry
        k, v, valid = load_kv(i)
        if qk8:  # K q8^T in FP8, asking for wgmma (fp8_fast_accum.py); with pv8 V^T (P 2^8) too
            st = plgpu.dot(k, q, trans_b=True, precision=fast) * sm.reshape(1, Gp)
        else:
            st = plgpu.dot(widen(k), q, trans_b=True, allow_tf32=False) * sm  # K q^T [N, Gp]
        st = jnp.where(valid[:, None], st, -jnp.inf)
        m_new = jnp.maximum(m, st.max(axis=0))
        alpha = jnp.exp2(m - m_new)
        p = jnp.exp2(st - m_new[None, :])
        l = l * alpha + p.sum(axis=0)
        if pv8:
            pv = plgpu.dot(v, (p * P_SCALE).astype(k_ref.dtype), trans_a=True, precision=fast)
        else:
            pv = plgpu.dot(v_operand(v, valid), p.astype(compute_dtype), trans_a=True,
                           allow_tf32=False)  # V^T P [D, Gp]
        acc = acc * alpha[None, :] + pv
        return acc, m_new, l

    m0 = jnp.full((Gp,), -jnp.inf, jnp.float32)
    l0 = jnp.zeros((Gp,), jnp.float32)
    body = body_kq if layout == "kq" else body_qk
    carry = (jnp.zeros((D, Gp) if layout == "kq" else (Gp, D), jnp.float32), m0, l0)
    if straight:
        for i in range(pps // bp):  # a step is taken iff its pages meet [start, end)
            lo = s * pps + i * bp
            take = (lo < end) & (lo + bp > start)
            carry = tuple(jnp.where(take, n, c) for n, c in zip(body(i, carry), carry))
    else:
        carry = jax.lax.fori_loop(0, n_iter, body, carry)
    acc, m, l = carry
    if layout == "kq":
        acc = acc.T

    has = l > 0
    o = jnp.where(has[:, None], acc / jnp.where(has, l, 1.0)[:, None], 0.0)
    out_mult = (F16_FROM_BITS if bits and not pv8 else 1.0) / (P_SCALE if pv8 else 1.0)
    if vs_ref is not None:
        o = o * (vs_ref[0] * out_mult)
    elif out_mult != 1.0:
        o = o * out_mult
    if split_out:
        plgpu.store(o_ref.at[b, h, s, row[:, None], col[None, :]], o, mask=rmask[:, None])
        lse = jnp.where(has, m + jnp.log2(jnp.where(has, l, 1.0)), -jnp.inf)
        plgpu.store(lse_ref.at[b, h, s, row], lse, mask=rmask)
    else:
        plgpu.store(o_ref.at[b, qrow[:, None], col[None, :]], o.astype(o_ref.dtype),
                    mask=rmask[:, None])


def paged_decode_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                           layer: jax.Array | int, block_tables: jax.Array,
                           seq_lens: jax.Array, *, scale: float, window: jax.Array | int = 0,
                           k_scale: jax.Array | float | None = None,
                           v_scale: jax.Array | float | None = None, interpret: bool = False,
                           block_tokens: int | None = None, num_splits: int | None = None,
                           target_programs: int | None = None, wave_slots: int | None = None,
                           num_warps: int | None = None,
                           num_stages: int | None = None, fp8_compute_dtype=jnp.float16,
                           fp8_widen: str | None = None, fp8_dots: str | None = None,
                           layout: str | None = None, group_rows: int | None = None,
                           fp8_v_stage: bool | None = None, fp8_variant: str | None = None,
                           unroll: int | None = None, merge: str = "auto",
                           merge_counters: jax.Array | None = None
                           ) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Decode attention (one query token per sequence) over a paged KV cache.

    Same contract as :func:`reference.paged_decode_attention_ref`. Method: FlashAttention-2's
    online softmax per (sequence, KV head, split), splits merged by log-sum-exp (Flash-Decoding;
    vLLM's paged_attention_v2), on vLLM's paged layout. Every tuning option left
    None takes, for an FP8 cache, the value of the named variant ``fp8_variant`` (None: the
    table's default, :data:`fp8.FP8_DECODE_DEFAULT` or ``$JAXINFER_FP8_DECODE``), then the
    default given below.

    Args:
      q: [B, Hq, D] bf16/f16/f32, queries at position ``seq_lens - 1``.
      k_cache, v_cache: [L, Hkv, P, ps, D] bf16/f16/f32 or float8_e4m3fn (with scales).
      layer: int32 scalar (may be traced, e.g. inside a scan over layers).
      block_tables: [B, maxp] int32 page ids. seq_lens: [B] int32 tokens (0 = padding row).
      scale: softmax scale. window: sliding window in tokens, 0 = none (int or traced int32).
      k_scale, v_scale: FP8 dequantisation scales (read = stored * scale), or None.
      interpret: run the Pallas interpreter (CPU tests).
      block_tokens: tokens per inner-loop step (pages per step = block_tokens / ps), a power
        of two (None: measured default, :func:`decode_options.default_block_tokens`; 32 for
        a 16-bit cache at D 256 with 16-132 (row, KV head) groups); raised to the page size
        if smaller (and to 16 with ``layout="kq"``).
      num_splits: split-K count, how many programs share one sequence's pages (None:
        :func:`choose_num_splits` with ``target_programs`` programs in the grid, or with
        ``wave_slots`` -- programs that run at once -- by wave efficiency).
      num_warps / num_stages: Triton launch / software-pipelining parameters (default 4 --
        8 for a 16-bit cache at D 256 below 8 (row, KV head) groups -- and
        :func:`decode_options.default_num_stages`: 5, or 4 for a 16-bit cache at D 64 / 128
        whose grid exceeds three programs an SM; stages 5 prefetches the K/V tiles a step ahead
        with Triton 3.x's pipeliner, stages 3-4 keep one buffer, no prefetch).
      fp8_compute_dtype: dtype FP8 K/V are widened to for the dots (f16: one instruction
        per two values from e4m3; q is clipped to the f16 range).
      fp8_widen: "cvt" (``astype``, default) or "bits" (exact bit placement into f16,
        integer ops; needs ``fp8_compute_dtype`` f16). fp8_dots: "none" (default), "qk"
        (QK^T in fp8, q quantized per row) or "qk_pv" (both dots in fp8); with
        ``layout="kq"`` the FP8 dots ask for wgmma (fp8_fast_accum.py). fp8_v_stage: widen
        V before its transposition (see fp8.py; default False).
        Only FP8 caches use these three; fp8.py and :data:`fp8.FP8_DECODE_VARIANTS` name
        the combinations.
      layout: "qk" (default: scores [rows, tokens], the q group is the MMA's M side,
        padded to >= 16 rows) or "kq" (scores transposed, K q^T [tokens, rows] and
        V^T P [D, rows]: tokens are the M side, the group padded to >= 8 rows).
      group_rows: rows the G = Hq / Hkv q heads of a program are padded to at least, a
        power of two (default and minimum: 16 with "qk", 8 with "kq").
      unroll: splits of at most this many steps run as straight-line code over the split's
        fixed page range (None: :data:`decode_options.DEFAULT_UNROLL`, 2, measured on the
        H200; 0: always the loop): the block-table read is issued before ``seq_lens``
        arrives, one dependent memory round trip less per program; steps outside the
        sequence (or window) are computed on masked loads and discarded.
      fp8_variant: name in :data:`fp8.FP8_DECODE_VARIANTS` (FP8 caches only), or "mgpu"
        (:data:`fp8.FP8_DECODE_OTHER`): the Mosaic GPU kernel of decode_mgpu.py (Hopper;
        ``num_splits`` / ``target_programs`` pass through, the other tuning options do not
        apply), the "by_batch" Triton variant where it does not take the shapes.
      merge: how the splits are merged (only with > 1 split): "xla" (f32 partials, then an
        XLA fusion: two launches), "kernel" (one launch: the last-arriving split of each
        (sequence, KV head) merges them in the kernel; decode_merge.py) or "auto" (default:
        "kernel" for B * Hkv <= decode_merge.MERGE_KERNEL_MAX_GROUPS when the merge runs
        straight-line, as measured on the H200; ``$JAXINFER_DECODE_MERGE`` overrides). The
        Mosaic GPU variant always merges in XLA.
      merge_counters: with merge="kernel" only: [B, Hkv] int32 zeros for the kernel's arrival
        counters (None: fresh zeros every call). Given, the call returns ``(out, counters)``,
        the counters zero again, for the caller to carry to the next call (e.g. a scan over
        layers) so that no zeroing runs per call.
    Returns:
      [B, Hq, D] in q.dtype; rows with seq_len 0 are zeros. ``(out, counters)`` when
      ``merge_counters`` is given.
    Raises:
      PagedAttentionShapeError: inconsistent shapes or dtypes (``merge_counters`` too).
      PagedAttentionUnsupportedError: shapes the kernel does not handle (see
        :func:`paged_decode_attention_supported`), or tokens a step not a power of two.
      ValueError: unknown ``fp8_widen`` / ``fp8_dots`` / ``layout`` / ``fp8_variant`` /
        ``merge`` (or ``$JAXINFER_FP8_DECODE`` / ``$JAXINFER_DECODE_MERGE`` value), a bad
        ``group_rows``, a negative or non-int ``unroll``, "bits" with a bf16 compute dtype, or
        ``merge_counters`` without merge="kernel".
    """
    _check(q, k_cache, v_cache, block_tables, seq_lens)
    decode_merge.check_merge(merge, merge_counters, q.shape[0], k_cache.shape[1])

    def ret(out, ctr=merge_counters):  # the counters too, when the caller passed them
        return out if merge_counters is None else (out, ctr)
    if (jnp.dtype(k_cache.dtype) == jnp.dtype(jnp.float8_e4m3fn)
            and fp8_decode_config(fp8_variant, q.shape[0]).get("backend") == "mgpu"):
        from pallas_kernels.paged_attention import decode_mgpu  # Mosaic GPU: only when asked
        if decode_mgpu.mgpu_decode_supported(q.shape, k_cache.shape, k_cache.dtype):
            cfg = decode_mgpu.MgpuDecodeConfig(num_splits=num_splits,
                                               target_programs=target_programs)
            return ret(decode_mgpu.paged_decode_attention_mgpu(
                q, k_cache, v_cache, layer, block_tables, seq_lens, scale=scale,
                window=window, k_scale=k_scale, v_scale=v_scale, config=cfg,
                interpret=interpret))
        fp8_variant = "by_batch"  # shapes the Mosaic kernel does not take: Triton's default
    o = _resolve_options(k_cache.dtype, fp8_variant, q.shape[0], k_cache.shape[1], q.shape[2],
                         block_tokens=block_tokens, num_splits=num_splits,
                         target_programs=target_programs, wave_slots=wave_slots,
                         num_warps=num_warps, num_stages=num_stages,
                         fp8_widen=fp8_widen, fp8_dots=fp8_dots, layout=layout,
                         group_rows=group_rows, fp8_v_stage=fp8_v_stage, unroll=unroll)
    if o["fp8_widen"] == "bits" and jnp.dtype(fp8_compute_dtype) != jnp.float16:
        raise ValueError("paged_decode_attention: fp8_widen='bits' widens to f16 only")
    B, Hq, D = q.shape
    _, Hkv, _, ps, _ = k_cache.shape
    if not _kernel_accepts(q.shape, k_cache.shape, k_cache.dtype):
        raise PagedAttentionUnsupportedError(
            f"paged_decode_attention: unsupported q{q.shape} k_cache{k_cache.shape} "
            f"{k_cache.dtype}; use paged_decode_attention_ref")
    G = Hq // Hkv
    Gp = max(o["group_rows"], _next_pow2(G))
    bt, bp, S, pps, num_stages = launch_grid(o, k_cache.dtype, B, Hkv, block_tables.shape[1],
                                             ps, D)
    straight = pps // bp <= o["unroll"]  # steps a split takes (>= 1) within the unroll

    operands, static_window, compute_dtype = scalar_operands(
        layer, window, k_scale, v_scale, k_cache.dtype, fp8_compute_dtype)
    operands += [block_tables, seq_lens, q, k_cache, v_cache]

    merge = decode_merge.resolve_merge(merge, B, Hkv, S, G, D)
    split_out = S > 1
    if split_out:
        out_shape = [jax.ShapeDtypeStruct((B, Hkv, S, G, D), jnp.float32),
                     jax.ShapeDtypeStruct((B, Hkv, S, G), jnp.float32)]
    else:
        out_shape = [jax.ShapeDtypeStruct((B, Hq, D), q.dtype)]
    fp8 = k_cache.dtype == jnp.float8_e4m3fn
    v_stage = fp8 and bool(o["fp8_v_stage"])
    name = (f"paged_decode_bt{bt}_s{S}" + (f"_{o['fp8_widen']}_{o['fp8_dots']}" if fp8 else "")
            + (f"_kq{Gp}" if o["layout"] == "kq" else "") + ("_vs" if v_stage else "")
            + ("_u" if straight else ""))
    kernel = functools.partial(
        _decode_kernel, ps=ps, bp=bp, pps=pps, G=G, Gp=Gp, D=D, scale_log2=scale * LOG2E,
        static_window=static_window, has_kscale=k_scale is not None,
        has_vscale=v_scale is not None, split_out=split_out, compute_dtype=compute_dtype,
        fp8_widen=o["fp8_widen"], fp8_dots=o["fp8_dots"], layout=o["layout"],
        v_stage=v_stage, straight=straight, interpret=interpret)
    params = plgpu.CompilerParams(num_warps=o["num_warps"], num_stages=num_stages)
    if split_out and merge == "kernel":
        return ret(*decode_merge.merged_call(
            kernel, operands, B=B, Hkv=Hkv, S=S, G=G, D=D, dtype=q.dtype, name=name,
            compiler_params=params, interpret=interpret, counters=merge_counters))
    outs = pl.pallas_call(kernel, grid=(B, Hkv, S), out_shape=out_shape, interpret=interpret,
                          compiler_params=params, name=name)(*operands)
    return ret(_merge_splits(outs[0], outs[1], q.dtype) if split_out else outs[0])
