"""Paged decode attention on Hopper: a warp-specialised Mosaic GPU kernel (FP8 or bf16 KV).

Pallas Mosaic GPU (``plgpu.kernel``), same contract as :func:`decode.paged_decode_attention`.
One CTA per (sequence, KV head, split) and two warpgroups (the layout of JAX's
``pallas/ops/gpu/attention_mgpu.py``, FlashAttention-3, Shah et al. 2024):

- the memory warpgroup reads the block table (scalar loads) and issues one TMA copy per page
  (a page of one KV head is a contiguous ``[ps, D]`` tile: 2 KB in FP8 at D = 128) into a
  ring of ``stages`` shared-memory slots of ``block_tokens`` tokens, for K and V;
- the compute warpgroup computes the scores with wgmma: ``S = q Kᵀ`` [64, T], the GQA group's
  G query rows padded to wgmma's M = 64 (rows past G are never written out). For FP8 both
  operands are e4m3 and K-major in shared memory (K [T, D] is D-contiguous): q is quantized
  per row into two e4m3 terms (the second its residual; each with its scale, folded with
  ``scale * log2(e) * k_scale`` into the row's softmax scale; :func:`_q_terms`), one wgmma
  each;
- V: FP8 wgmma needs K-major operands and V [T, D] is MN-major for ``P V``, so each V tile
  is read into registers, widened to f16 (bf16 caches: kept), multiplied by nothing but
  masked (tokens past the length / before the window / of another split are set to 0, so a
  poisoned page cannot leak NaN through ``0 * NaN``), stored to a 16-bit staging tile and fed
  to a 16-bit wgmma with P (f16/bf16, registers) as A;
- online softmax in base 2, f32; each split writes its normalised partial output (f16 / bf16
  [8, D], rows past G unused) and its base-2 log-sum-exp, merged exactly in XLA
  (:func:`decode_options._merge_splits`, Flash-Decoding); ``v_scale`` multiplies the merged output.

Sliding windows (static or traced) are handled: pages before the window are not loaded.
Shapes: D = 128 only (one 128-byte swizzled row per FP8 token; 64 / 256 untested, refused),
page size a multiple of 8 dividing ``block_tokens``, G = Hq / Hkv <= 8. Anything else raises
:class:`PagedAttentionUnsupportedError` (callers fall back to the Triton kernel).

Numerics (CPU interpreter, against the f32 reference on the same FP8 cache): ~1.4e-3
relative L2 error with two q terms, ~1.7e-2 with one (``q_terms=1``, the ``qk8`` arithmetic
of fp8.py); P and the partial outputs are f16 (bf16 for a bf16 cache).
Design notes: benchmarks/kernels/NOTES_paged_attention.md; GPU check and timing:
benchmarks/kernels/check_decode_mgpu.py.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.paged_attention.decode_options import _check, _merge_splits, split_grid
from pallas_kernels.paged_attention.errors import PagedAttentionUnsupportedError
from pallas_kernels.paged_attention.fp8 import quantize_rows_e4m3

LOG2E = math.log2(math.e)
F8 = jnp.float8_e4m3fn
QROWS = 8  # q rows copied per CTA (the group, zero-padded); wgmma's M is 64
M = 64


@dataclasses.dataclass(frozen=True)
class MgpuDecodeConfig:
    """block_tokens KV tokens per step (a multiple of 64 and of the page size), stages
    shared-memory slots in the ring, target_programs / num_splits as in the Triton kernel;
    p_smem: P goes to the P V wgmma through shared memory instead of registers (the Mosaic
    GPU interpreter of JAX 0.11.2 takes wgmma operands from shared memory only); regs:
    (compute, memory) warpgroup register counts for ``setmaxnreg`` (None: ptxas's choice);
    q_terms: FP8 q as 1 or 2 e4m3 terms (:func:`_q_terms`; 2: one more wgmma a step);
    heads_per_cta: 1, or 2 compute warpgroups a CTA, one KV head each, fed by one memory
    warpgroup (two independent softmax chains an SM, FlashAttention-3's 2 + 1 warpgroups;
    odd Hkv falls back to 1); v_layout: register layout V is read from shared memory in
    ("WGMMA": 2-byte loads of FP8; "WGMMA_UPCAST_2X": 4-byte loads, made for widening);
    fresh_acc: P V into a zeroed accumulator, added in registers (the interpreter's path;
    default: accumulate in place through ``pl.run_state``).
    Raises ValueError on construction unless block_tokens is 64, 128, 192 or 256, stages >= 2,
    q_terms and heads_per_cta are 1 or 2 and v_layout one of the two names."""
    block_tokens: int = 64
    stages: int = 4
    num_splits: int | None = None
    target_programs: int | None = None
    p_smem: bool = False
    q_terms: int = 2
    heads_per_cta: int = 1
    v_layout: str = "WGMMA"
    fresh_acc: bool = False
    regs: tuple[int, int] | None = None

    def __post_init__(self):
        if (self.block_tokens % 64 or not 64 <= self.block_tokens <= 256 or self.stages < 2
                or self.q_terms not in (1, 2) or self.heads_per_cta not in (1, 2)
                or self.v_layout not in ("WGMMA", "WGMMA_UPCAST_2X")):
            raise ValueError(f"bad MgpuDecodeConfig {self}")


def _transforms(dtype):
    bits = jnp.dtype(dtype).itemsize * 8
    return (plgpu.TilingTransform((8, 1024 // bits)), plgpu.SwizzleTransform(128))


def _kernel(layer_ref, win_ref, bt_ref, len_ref, qs_ref, q_ref, k_ref, v_ref, o_ref, lse_ref,
            scoped, *, ps: int, bp: int, pps: int, maxp: int, stages: int, wdtype,
            regs: tuple[int, int] | None, fresh_acc: bool, hpc: int, v_layout) -> None:
    (q_all, k_all, v_all, w_all, lse_all, *p_all), bars, (k_done, v_done) = scoped
    k_bar, v_bar, q_bar = bars
    T = bp * ps
    b, hg, s = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("s")
    wg = lax.axis_index("wg")  # compute warpgroups 0 .. hpc - 1 (one KV head each), memory
    seq_len = len_ref[b]
    window = win_ref[0]
    first_tok = jnp.where(window > 0, jnp.maximum(seq_len - window, 0), 0)
    n_pages = (seq_len + ps - 1) // ps
    start = jnp.maximum(s * pps, first_tok // ps)  # first block-table column of this split
    end = jnp.minimum((s + 1) * pps, n_pages)  # one past the last column
    n_iter = (jnp.maximum(end - start, 0) + bp - 1) // bp
    tok_hi = jnp.minimum(seq_len, end * ps)  # valid tokens: [first_tok, tok_hi)

    @pl.when(wg < hpc)
    def _compute():
        if regs:
            plgpu.set_max_registers(regs[0], action="increase")
        h = hg * hpc + wg  # this warpgroup's KV head
        q_smem, k_smem, v_smem = q_all.at[wg], k_all.at[wg], v_all.at[wg]
        w_smem, lse_smem = w_all.at[wg], lse_all.at[wg]
        p_smem = p_all[0].at[wg] if p_all else None
        bar0 = wg * stages  # this warpgroup's ring barriers: bar0 + slot
        nq = q_smem.shape[0]  # q terms (FP8: q ~ sum_t q8_t * scale_t, per row)
        for t in range(nq):
            plgpu.copy_gmem_to_smem(q_ref.at[b, h, t], q_smem.at[t, pl.ds(0, QROWS)],
                                    q_bar.at[wg])
        row_layout = plgpu.Layout.WGMMA.reduce(1)
        sms = [plgpu.load(qs_ref.at[b, h, t], layout=row_layout, optimized=False)
               for t in range(nq)]
        plgpu.barrier_wait(q_bar.at[wg])
        D = q_smem.shape[2]

        def step(i, carry):
            acc, m_i, l_i = carry
            slot = lax.rem(i, jnp.int32(stages))
            base = (start + i * bp) * ps  # position of the step's first token
            plgpu.barrier_wait(k_bar.at[bar0 + slot])

            sc = None
            for t in range(nq):  # scores in log2 units: sum_t (q8_t K^T) * row scale_t
                def qk_scope(acc_ref, t=t):
                    plgpu.wgmma(acc_ref, q_smem.at[t], k_smem.at[slot].transpose((1, 0)))
                    return acc_ref[...]
                st = pl.run_scoped(qk_scope, plgpu.ACC((M, T), jnp.float32))
                st = st * lax.broadcast_in_dim(sms[t], (M, T), [0])
                sc = st if sc is None else sc + st
            plgpu.barrier_arrive(k_done.at[bar0 + slot])
            tok = plgpu.broadcasted_iota(jnp.int32, (M, T), 1, layout=plgpu.Layout.WGMMA) + base
            valid = (tok >= first_tok) & (tok < tok_hi)
            sc = jnp.where(valid, sc, -jnp.inf)
            m_new = jnp.maximum(m_i, sc.max(axis=1))  # finite: every step has a valid token
            alpha = jnp.exp2(m_i - m_new)
            p = jnp.exp2(sc - lax.broadcast_in_dim(m_new, (M, T), [0]))
            l_i = l_i * alpha + p.sum(axis=1)
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            # V: registers, widened and masked, into the 16-bit staging tile.
            plgpu.barrier_wait(v_bar.at[bar0 + slot])
            v = plgpu.load(v_smem.at[slot], layout=v_layout, optimized=False)
            plgpu.barrier_arrive(v_done.at[bar0 + slot])
            vt = plgpu.broadcasted_iota(jnp.int32, (T, D), 0, layout=v_layout) + base
            v = jnp.where((vt >= first_tok) & (vt < tok_hi), v.astype(wdtype),
                          jnp.zeros((), wdtype))
            w_smem[...] = v
            p16 = p.astype(wdtype)
            if p_smem is not None:  # P through shared memory (the interpreter needs it)
                p_smem[...] = p16
                p16 = p_smem
            plgpu.commit_smem()

            if fresh_acc:  # the interpreter has no run_state: a zeroed accumulator, added
                def pv_scope(acc_ref):
                    plgpu.wgmma(acc_ref, p16, w_smem)
                    return acc_ref[...]
                acc = acc + pl.run_scoped(pv_scope, plgpu.ACC((M, D), jnp.float32))
            else:
                def pv(acc_ref):
                    plgpu.wgmma(acc_ref, p16, w_smem)
                acc = pl.run_state(pv)(plgpu.ACC.init(acc))
            return acc, m_new, l_i

        m0 = plgpu.layout_cast(jnp.full((M,), -jnp.inf, jnp.float32), row_layout)
        l0 = plgpu.layout_cast(jnp.full((M,), 0, jnp.float32), row_layout)
        acc0 = plgpu.layout_cast(jnp.full((M, D), 0, jnp.float32), plgpu.Layout.WGMMA)
        acc, m_i, l_i = lax.fori_loop(0, n_iter, step, (acc0, m0, l0))
        has = l_i > 0
        l_safe = jnp.where(has, l_i, 1.0)
        acc = acc / lax.broadcast_in_dim(l_safe, (M, D), [0])
        lse_smem[...] = jnp.where(has, m_i + jnp.log2(l_safe), -jnp.inf)
        w_smem.at[pl.ds(0, M)][...] = acc.astype(wdtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(w_smem.at[pl.ds(0, QROWS)], o_ref.at[b, h, s])
        plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[b, h, s])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == hpc)
    def _memory():
        if regs:
            plgpu.set_max_registers(regs[1], action="decrease")
        layer = layer_ref[0]

        def pages(i):  # the step's block-table entries (past the table: its last column)
            return [bt_ref[b, jnp.minimum(start + i * bp + j, maxp - 1)] for j in range(bp)]

        def load(pg, slot, cache, smem, bar, done=None):
            for w in range(hpc):  # the same pages of each KV head of this CTA
                if done is not None:
                    plgpu.barrier_wait(done.at[w * stages + slot])
                for j in range(bp):
                    plgpu.copy_gmem_to_smem(cache.at[layer, hg * hpc + w, pg[j]],
                                            smem.at[w, slot, pl.ds(j * ps, ps)],
                                            bar.at[w * stages + slot])

        for i in range(stages):
            @pl.when(i < n_iter)
            def _(i=i):
                pg = pages(i)
                load(pg, i, k_ref, k_all, k_bar)
                load(pg, i, v_ref, v_all, v_bar)

        @pl.loop(stages, jnp.maximum(n_iter, stages))
        def _(i):
            slot = lax.rem(i, jnp.int32(stages))
            pg = pages(i)
            load(pg, slot, k_ref, k_all, k_bar, k_done)
            load(pg, slot, v_ref, v_all, v_bar, v_done)


def _q_terms(q: jax.Array, Hkv: int, scale: float, k_scale, n: int):
    """q [B, Hq, D] -> (terms [B, Hkv, max(n, 1), 8, D], row scales [B, Hkv, max(n, 1), 64]).

    n = 0 (bf16 cache): q in bf16, one term. n >= 1 (FP8): e4m3 terms with per-row scales,
    q ~= sum_t terms[t] * scale_t (term 2 quantizes the residual of term 1: about 2^-8
    relative error instead of 2^-4). The G group rows are zero-padded to 8; the row scales
    hold ``scale * log2(e) * k_scale`` (1 for the padding rows past 8).
    """
    B, Hq, D = q.shape
    G = Hq // Hkv
    qg = q.astype(jnp.float32).reshape(B, Hkv, G, D)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, QROWS - G), (0, 0))).reshape(-1, D)
    base = scale * LOG2E * (1.0 if k_scale is None else jnp.asarray(k_scale, jnp.float32))
    if n == 0:
        terms, scales = [qg.astype(jnp.bfloat16)], [jnp.ones(qg.shape[:1], jnp.float32)]
    else:
        terms, scales, r = [], [], qg
        for _ in range(n):
            q8, sc = quantize_rows_e4m3(r)
            terms.append(q8)
            scales.append(sc)
            r = r - q8.astype(jnp.float32) * sc[:, None]
    n = len(terms)
    t = jnp.stack(terms, 1).reshape(B, Hkv, QROWS, n, D).transpose(0, 1, 3, 2, 4)
    s = (jnp.stack(scales, 1) * base).reshape(B, Hkv, QROWS, n).transpose(0, 1, 3, 2)
    return t, jnp.pad(s, ((0, 0), (0, 0), (0, 0), (0, M - QROWS)), constant_values=1.0)


def mgpu_decode_supported(q_shape: tuple[int, ...], k_cache_shape: tuple[int, ...], kv_dtype,
                          block_tokens: int = 64) -> bool:
    """Whether :func:`paged_decode_attention_mgpu` takes these shapes: FP8 e4m3 or bf16 cache,
    D = 128, page size dividing ``block_tokens`` (and a multiple of 8), G = Hq / Hkv <= 8."""
    if len(q_shape) != 3 or len(k_cache_shape) != 5:
        return False
    _, Hq, D = q_shape
    _, Hkv, _, ps, Dk = k_cache_shape
    return (D == Dk == 128 and Hkv > 0 and Hq % Hkv == 0 and Hq // Hkv <= QROWS
            and ps % 8 == 0 and block_tokens % ps == 0
            and jnp.dtype(kv_dtype) in (jnp.dtype(F8), jnp.dtype(jnp.bfloat16)))


def paged_decode_attention_mgpu(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                                layer: jax.Array | int, block_tables: jax.Array,
                                seq_lens: jax.Array, *, scale: float,
                                window: jax.Array | int = 0,
                                k_scale: jax.Array | float | None = None,
                                v_scale: jax.Array | float | None = None,
                                config: MgpuDecodeConfig | None = None,
                                interpret: bool = False) -> jax.Array:
    """Decode attention over a paged KV cache with the Mosaic GPU kernel (Hopper): warp
    specialisation after FlashAttention-3 / JAX's attention_mgpu.py, Flash-Decoding splits.

    Same contract as :func:`reference.paged_decode_attention_ref`:
      q: [B, Hq, D] bf16/f16/f32 at position ``seq_lens - 1``; k_cache, v_cache:
      [L, Hkv, P, ps, D] float8_e4m3fn (with ``k_scale`` / ``v_scale``, read = stored * scale)
      or bf16; layer: int32 scalar (may be traced); block_tables: [B, maxp] int32;
      seq_lens: [B] int32 tokens (0 = padding row); window: in tokens, 0 = none, int or
      traced int32 scalar.
      config: :class:`MgpuDecodeConfig` (tokens per step, ring stages, splits).
      interpret: the Mosaic GPU interpreter (CPU tests).
    Returns:
      [B, Hq, D] in q.dtype; rows with seq_len 0 are zeros.
    Raises:
      PagedAttentionShapeError: inconsistent shapes or dtypes.
      PagedAttentionUnsupportedError: outside :func:`mgpu_decode_supported` (at
        ``config.block_tokens``).
    """
    cfg = config or MgpuDecodeConfig()
    if interpret:
        cfg = dataclasses.replace(cfg, p_smem=True)
    _check(q, k_cache, v_cache, block_tables, seq_lens)
    if not mgpu_decode_supported(q.shape, k_cache.shape, k_cache.dtype, cfg.block_tokens):
        raise PagedAttentionUnsupportedError(
            f"paged_decode_attention_mgpu: unsupported q{q.shape} k_cache{k_cache.shape} "
            f"{k_cache.dtype} block_tokens={cfg.block_tokens}; use the Triton kernel")
    B, Hq, D = q.shape
    _, Hkv, _, ps, _ = k_cache.shape
    G = Hq // Hkv
    fp8 = k_cache.dtype == F8
    wdtype = jnp.float16 if fp8 else jnp.bfloat16
    T = cfg.block_tokens
    bp = T // ps
    maxp = block_tables.shape[1]
    S, pps = split_grid(B, Hkv, maxp, bp, cfg.num_splits, cfg.target_programs)

    qk, row_scale = _q_terms(q, Hkv, scale, k_scale, cfg.q_terms if fp8 else 0)
    nq = qk.shape[2]
    layer_a = jnp.asarray(layer, jnp.int32).reshape(1)
    win_a = jnp.asarray(window, jnp.int32).reshape(1)

    kv_dt = k_cache.dtype
    hpc = cfg.heads_per_cta if Hkv % cfg.heads_per_cta == 0 else 1
    tf_kv, tf_w = _transforms(kv_dt), _transforms(wdtype)
    kernel = functools.partial(_kernel, ps=ps, bp=bp, pps=pps, maxp=maxp,
                               stages=cfg.stages, wdtype=wdtype, regs=cfg.regs,
                               fresh_acc=interpret or cfg.fresh_acc, hpc=hpc,
                               v_layout=getattr(plgpu.Layout, cfg.v_layout))

    def entry(layer_ref, win_ref, bt_ref, len_ref, qs_ref, q_ref, k_ref, v_ref, o_ref,
              lse_ref):
        pl.run_scoped(
            lambda *scoped: kernel(layer_ref, win_ref, bt_ref, len_ref, qs_ref, q_ref, k_ref,
                                   v_ref, o_ref, lse_ref, scoped),
            (plgpu.SMEM((hpc, nq, M, D), qk.dtype, transforms=tf_kv),
             plgpu.SMEM((hpc, cfg.stages, T, D), kv_dt, transforms=tf_kv),
             plgpu.SMEM((hpc, cfg.stages, T, D), kv_dt, transforms=tf_kv),
             plgpu.SMEM((hpc, max(T, M), D), wdtype, transforms=tf_w),
             plgpu.SMEM((hpc, M), jnp.float32),
             *([plgpu.SMEM((hpc, M, T), wdtype, transforms=tf_w)] if cfg.p_smem else [])),
            (plgpu.Barrier(num_arrivals=bp, num_barriers=hpc * cfg.stages),
             plgpu.Barrier(num_arrivals=bp, num_barriers=hpc * cfg.stages),
             plgpu.Barrier(num_arrivals=nq, num_barriers=hpc)),
            (plgpu.Barrier(num_barriers=hpc * cfg.stages),) * 2,
            collective_axes="wg")

    params: dict = {"compiler_params": plgpu.CompilerParams(approx_math=True)}
    if interpret:
        params = {"interpret": plgpu.InterpretGPUParams()}
    o, lse = plgpu.kernel(
        entry,
        out_type=(jax.ShapeDtypeStruct((B, Hkv, S, QROWS, D), wdtype),
                  jax.ShapeDtypeStruct((B, Hkv, S, M), jnp.float32)),
        grid=(B, Hkv // hpc, S), grid_names=("b", "h", "s"), num_threads=hpc + 1,
        thread_name="wg",
        **params,
    )(layer_a, win_a, block_tables, seq_lens, row_scale, qk, k_cache, v_cache)
    out = _merge_splits(o[:, :, :, :G].astype(jnp.float32), lse[..., :G], jnp.float32)
    if v_scale is not None:
        out = out * jnp.asarray(v_scale, jnp.float32)
    out = jnp.where((seq_lens > 0)[:, None, None], out, 0.0)
    return out.astype(q.dtype)
