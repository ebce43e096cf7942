"""Packed ragged causal prefill attention on Hopper: a varlen FlashAttention-3 kernel.

Mosaic GPU (Pallas ``plgpu.kernel``), adapted from JAX's ``pallas/ops/gpu/attention_mgpu.py``
(FlashAttention-3, Shah et al. 2024): per CTA two compute warpgroups (``block_q`` query
rows each, one q head) and one memory warpgroup streaming K/V tiles by TMA into a ring of
``max_concurrent_steps`` shared-memory slots, wgmma for QKᵀ and PV, online softmax in base 2.

What differs from the stock kernel (which takes one dense [B, n, H, D] batch):
- Queries are the engine's packed ragged tokens [T, Hq, D] of several sequences (padded to a
  multiple of ``2 * block_q``); a q tile may hold tokens of several sequences.
- K/V are first gathered from the pages (:func:`plan`, plain XLA ops) into one contiguous
  buffer [Tk, Hkv, D]: each sequence's whole context (cached prefix + new tokens) at offset
  ``kbase[s]``, zeros elsewhere. Row ``t`` may see buffer entries ``[row_lo[t], row_hi[t]]``
  (causal, sliding window); padding rows see nothing and give zeros.
- Per q tile the planner lists the KV steps (``block_kv`` buffer entries) some row sees and
  the ones all rows see in full: those run without a mask. A CTA's memory warpgroup loads
  the union of its two tiles' steps; a compute warpgroup passes over steps outside its own
  range (it still waits on and releases their barriers, so the phases stay in step).
- Scale: ``scale * log2(e)`` folds into the exponent's FMA; rows that see no key in a masked
  step keep ``m = -inf`` and add nothing.

The buffer has a static size ``kv_capacity``: by default the least of 2 T and the bucket's
worst case (:func:`worst_case_context`: the sum of the contexts of at most min(S, T) sequences
of at most ``maxp * page_size`` tokens each, known from the shapes alone). Where the worst case
fits, no fallback is compiled: the program is static (no ``lax.cond``). Where it does not (the
engine's Pallas buckets, S = 64 rows of 272 pages: 278,528 tokens, a 1.1 GB gather per layer
for K and V at 8B, far more than the kernel saves), :func:`paged_prefill_attention_mgpu` falls
back to the Triton kernel (``prefill.py``) through ``lax.cond`` when the contexts exceed the
buffer, so it is exact in every case; on XLA:GPU that cond is a host sync per layer
(jaxinfer/sampling.py docstring). ``prefill_mgpu_route.mgpu_route`` is the static per-bucket
choice the ``pallas_mgpu`` attention backend makes (Triton below ``MGPU_MIN_TOKENS`` tokens,
and for buckets that could overflow when ``MGPU_OVERFLOW`` is ``"triton"``), with the
kernel's shape checks (``paged_prefill_mgpu_supported``).

Compile time: :func:`paged_prefill_attention_mgpu` runs under a module-level ``jax.jit``
(:func:`_mgpu_prefill_jit`, static config / scale / capacity), so the unrolled layers of one
program share one traced and lowered function (XLA inlines it): the Mosaic kernel (and the
Triton fallback) is lowered once per shape, not once per layer (as ``_fp8_kernel_linear`` in
jaxinfer/models/transformer.py does for the FP8 GEMMs; benchmarks/lower_prefill_cuda.py).

bf16 / f16 caches only (no FP8), D % 64 == 0.
Benchmark: benchmarks/kernels/bench_paged_prefill.py (``mgpu_varlen``).
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

from pallas_kernels.paged_attention.prefill import paged_prefill_attention
from pallas_kernels.paged_attention.prefill_mgpu_route import (
    default_kv_capacity,
    worst_case_context,
)


@dataclasses.dataclass(frozen=True)
class MgpuPrefillConfig:
    """block_q query rows per compute warpgroup (two per CTA), block_kv KV entries per step,
    max_concurrent_steps K/V slots in shared memory. Raises ValueError on construction unless
    block_q and block_kv are multiples of 64 and max_concurrent_steps >= 2."""
    block_q: int = 64
    block_kv: int = 128
    max_concurrent_steps: int = 2

    def __post_init__(self):
        if self.block_q % 64 or self.block_kv % 64 or self.max_concurrent_steps < 2:
            raise ValueError(f"bad MgpuPrefillConfig {self}")


def _cdiv(a, b):
    return (a + b - 1) // b


def plan(k_cache: jax.Array, v_cache: jax.Array, layer: jax.Array | int,
         block_tables: jax.Array, seq_lens: jax.Array, positions: jax.Array,
         seq_ids: jax.Array, window: jax.Array | int, *, kv_capacity: int,
         cfg: MgpuPrefillConfig) -> tuple:
    """Gathered K/V and the per-row / per-tile KV ranges the kernel reads (pure jnp).

    Returns (k_buf, v_buf, rows, tiles, pairs, fits):
      k_buf, v_buf: [Tk, Hkv, D], Tk = kv_capacity rounded up to block_kv; sequence s's
        context token j at ``kbase[s] + j`` (kbase = exclusive cumsum of seq_lens), zeros
        past the contexts.
      rows: [2, Tq] int32, Tq = T rounded up to 2 * block_q: inclusive buffer range
        (lo, hi) each query row sees; (1, 0) (empty) for padding.
      tiles: [ntiles * 4] int32 per tile of block_q rows: (lo, full_lo, full_hi, hi) in KV
        steps; steps [lo, hi) hold a visible entry, [full_lo, full_hi) are visible to every
        real row (no mask). Empty tiles: all four equal their pair's lo.
      pairs: [npairs * 2] int32 per CTA (tiles 2p, 2p + 1): the union (lo, hi) of steps.
      fits: whether sum(seq_lens) <= Tk (else the buffer is wrong: caller falls back).
    """
    T = positions.shape[0]
    S = seq_lens.shape[0]
    _, _, _, ps, _ = k_cache.shape
    bq, bkv = cfg.block_q, cfg.block_kv
    Tk = _cdiv(kv_capacity, bkv) * bkv
    Tq = _cdiv(T, 2 * bq) * 2 * bq
    ends = jnp.cumsum(seq_lens)
    kbase = ends - seq_lens
    fits = ends[-1] <= Tk

    # Gather: entry j belongs to sequence s = #ends <= j, token j - kbase[s].
    j = jnp.arange(Tk, dtype=jnp.int32)
    s = jnp.minimum(jnp.searchsorted(ends, j, side="right"), S - 1).astype(jnp.int32)
    tok = j - kbase[s]
    valid = (tok >= 0) & (tok < seq_lens[s])
    tok = jnp.where(valid, tok, 0)
    page = block_tables[s, tok // ps]
    off = tok % ps

    def gather(cache):  # [L, Hkv, P, ps, D] -> [Tk, Hkv, D]
        x = cache[layer][:, page, off]  # [Hkv, Tk, D]
        return jnp.where(valid[None, :, None], x, 0).transpose(1, 0, 2)

    # Rows: inclusive buffer range each query token sees.
    real = seq_ids >= 0
    sid = jnp.where(real, seq_ids, 0)
    window = jnp.asarray(window, jnp.int32)
    first = jnp.where(window > 0, jnp.maximum(positions - window + 1, 0), 0)
    lo = jnp.where(real, kbase[sid] + first, 1)
    hi = jnp.where(real, kbase[sid] + positions, 0)
    real = jnp.pad(real, (0, Tq - T))
    lo, hi = jnp.pad(lo, (0, Tq - T), constant_values=1), jnp.pad(hi, (0, Tq - T))
    rows = jnp.stack([lo, hi]).astype(jnp.int32)

    # Tiles: visible steps and the steps every real row sees in full.
    big = jnp.int32(2**30)
    rt, lt, ht = real.reshape(-1, bq), lo.reshape(-1, bq), hi.reshape(-1, bq)
    nonempty = rt.any(axis=1)
    t_lo = jnp.where(rt, lt, big).min(axis=1) // bkv
    t_hi = _cdiv(jnp.where(rt, ht, -1).max(axis=1) + 1, bkv)
    f_lo = _cdiv(jnp.where(rt, lt, -1).max(axis=1), bkv)
    f_hi = (jnp.where(rt, ht, big).min(axis=1) + 1) // bkv
    p_lo = jnp.where(nonempty, t_lo, big).reshape(-1, 2).min(axis=1)
    p_hi = jnp.where(nonempty, t_hi, -1).reshape(-1, 2).max(axis=1)
    pair_empty = p_hi < 0
    p_lo, p_hi = jnp.where(pair_empty, 0, p_lo), jnp.where(pair_empty, 0, p_hi)
    pl_t = jnp.repeat(p_lo, 2)
    t_lo, t_hi = jnp.where(nonempty, t_lo, pl_t), jnp.where(nonempty, t_hi, pl_t)
    f_lo = jnp.clip(f_lo, t_lo, t_hi)
    f_hi = jnp.clip(f_hi, f_lo, t_hi)
    tiles = jnp.stack([t_lo, f_lo, f_hi, t_hi], axis=1).astype(jnp.int32).reshape(-1)
    pairs = jnp.stack([p_lo, p_hi], axis=1).astype(jnp.int32).reshape(-1)
    return gather(k_cache), gather(v_cache), rows, tiles, pairs, fits


def _kernel(rows_ref, tiles_ref, pairs_ref, q_ref, k_ref, v_ref, out_ref, scoped, *,
            cfg: MgpuPrefillConfig, G: int, D: int, c_log2: float, dtype) -> None:
    bq, bkv, mcs = cfg.block_q, cfg.block_kv, cfg.max_concurrent_steps
    (qo_smem2, k_smem, v_smem), (k_bar, v_bar, q_bar), (k_done, v_done), sched = scoped
    q_head = lax.axis_index("heads")
    pair = lax.axis_index("q_seq")
    wg = lax.axis_index("wg")
    plo, phi = pairs_ref[2 * pair], pairs_ref[2 * pair + 1]

    def slot_of(step):
        return lax.rem(step - plo, jnp.int32(mcs))

    def sched_barrier():
        plgpu.barrier_arrive(sched)
        plgpu.barrier_wait(sched)

    @pl.when(wg < 2)
    def _compute():
        plgpu.set_max_registers(232, action="increase")
        tile = 2 * pair + wg
        lo, flo = tiles_ref[4 * tile], tiles_ref[4 * tile + 1]
        fhi, hi = tiles_ref[4 * tile + 2], tiles_ref[4 * tile + 3]
        qo = qo_smem2.at[wg]
        base = tile * bq
        plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(base, bq), q_head], qo, q_bar.at[wg])
        row_layout = plgpu.Layout.WGMMA.reduce(1)
        r_lo = plgpu.load(rows_ref.at[0, pl.ds(base, bq)], layout=row_layout, optimized=False)
        r_hi = plgpu.load(rows_ref.at[1, pl.ds(base, bq)], layout=row_layout, optimized=False)
        plgpu.barrier_wait(q_bar.at[wg])
        m_i = plgpu.layout_cast(jnp.full((bq,), -jnp.inf, jnp.float32), row_layout)
        l_i = plgpu.layout_cast(jnp.full((bq,), 0, jnp.float32), row_layout)
        acc = plgpu.layout_cast(jnp.full((bq, D), 0, jnp.float32), plgpu.Layout.WGMMA)

        @pl.when(phi > plo)
        def _():
            plgpu.barrier_wait(k_bar.at[0])

        pl.when(wg == 1)(sched_barrier)

        def wait_next_k(step):
            @pl.when(step + 1 < phi)
            def _():
                plgpu.barrier_wait(k_bar.at[slot_of(step + 1)])

        def kv_step(step, carry, masked: bool):
            acc, m_i, l_i = carry
            slot = slot_of(step)

            def qk_scope(acc_ref):
                plgpu.wgmma(acc_ref, qo, k_smem.at[slot].transpose((1, 0)))
                sched_barrier()
                return acc_ref[...]
            qk = pl.run_scoped(qk_scope, plgpu.ACC((bq, bkv), jnp.float32))
            plgpu.barrier_arrive(k_done.at[slot])
            if masked:
                kv = plgpu.broadcasted_iota(jnp.int32, (bq, bkv), 1,
                                            layout=plgpu.Layout.WGMMA) + step * bkv
                lo_b = lax.broadcast_in_dim(r_lo, (bq, bkv), [0])
                hi_b = lax.broadcast_in_dim(r_hi, (bq, bkv), [0])
                qk = jnp.where((kv >= lo_b) & (kv <= hi_b), qk, -jnp.inf)
            m_ij = jnp.maximum(m_i, qk.max(axis=1) * c_log2)
            # A row with no visible key yet keeps m = -inf: subtract 0 so p = 0, not NaN.
            m_use = jnp.where(m_ij == -jnp.inf, 0.0, m_ij) if masked else m_ij
            alpha = jnp.exp2(m_i - m_use)
            p = jnp.exp2(qk * c_log2 - lax.broadcast_in_dim(m_use, qk.shape, [0]))
            acc *= lax.broadcast_in_dim(alpha, acc.shape, [0])
            l_i = l_i * alpha + p.sum(axis=1)
            p16 = p.astype(dtype)
            acc, l_i, m_ij, p16 = lax.optimization_barrier((acc, l_i, m_ij, p16))
            plgpu.barrier_arrive(sched)
            plgpu.barrier_wait(v_bar.at[slot])
            plgpu.barrier_wait(sched)

            def pv(acc_ref):
                plgpu.wgmma(acc_ref, p16, v_smem.at[slot])
                wait_next_k(step)
            acc = pl.run_state(pv)(plgpu.ACC.init(acc))
            plgpu.barrier_arrive(v_done.at[slot])
            return acc, m_ij, l_i

        def skip_step(step, _):
            # Another tile of this CTA needs the step: release it, keep barriers in phase.
            slot = slot_of(step)
            plgpu.barrier_arrive(k_done.at[slot])
            sched_barrier()
            plgpu.barrier_wait(v_bar.at[slot])
            sched_barrier()
            plgpu.barrier_arrive(v_done.at[slot])
            wait_next_k(step)

        lax.fori_loop(plo, lo, skip_step, None)
        carry = (acc, m_i, l_i)
        carry = lax.fori_loop(lo, flo, functools.partial(kv_step, masked=True), carry)
        carry = lax.fori_loop(flo, fhi, functools.partial(kv_step, masked=False), carry)
        acc, m_i, l_i = lax.fori_loop(fhi, hi, functools.partial(kv_step, masked=True), carry)
        lax.fori_loop(hi, phi, skip_step, None)
        pl.when(wg == 0)(sched_barrier)

        l_safe = jnp.where(l_i > 0, l_i, 1.0)
        acc /= lax.broadcast_in_dim(l_safe, (bq, D), [0])
        qo[...] = acc.astype(dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(qo, out_ref.at[pl.ds(base, bq), q_head])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 2)
    def _memory():
        plgpu.set_max_registers(40, action="decrease")
        kv_head = lax.div(q_head, jnp.int32(G))

        def load(step, slot):
            s = (pl.ds(step * bkv, bkv), kv_head)
            plgpu.copy_gmem_to_smem(k_ref.at[s], k_smem.at[slot], k_bar.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[s], v_smem.at[slot], v_bar.at[slot])

        for i in range(mcs):
            pl.when(plo + i < phi)(functools.partial(load, plo + i, i))

        @pl.loop(plo + mcs, jnp.maximum(phi, plo + mcs))
        def _(step):
            slot = slot_of(step)
            s = (pl.ds(step * bkv, bkv), kv_head)
            plgpu.barrier_wait(k_done.at[slot])
            plgpu.copy_gmem_to_smem(k_ref.at[s], k_smem.at[slot], k_bar.at[slot])
            plgpu.barrier_wait(v_done.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[s], v_smem.at[slot], v_bar.at[slot])


def varlen_attention(q: jax.Array, k_buf: jax.Array, v_buf: jax.Array, rows: jax.Array,
                     tiles: jax.Array, pairs: jax.Array, *, scale: float,
                     cfg: MgpuPrefillConfig, interpret: bool = False) -> jax.Array:
    """The kernel alone: q [Tq, Hq, D] (Tq % (2 block_q) == 0), k/v_buf [Tk, Hkv, D] and the
    ranges of :func:`plan` -> [Tq, Hq, D] (rows that see nothing give zeros).

    ``interpret``: the Mosaic GPU interpreter; it does not run this kernel in JAX 0.11.2
    (``Cannot lower jaxpr with effects`` for the wgmma accumulators), kept for later JAX.
    Raises ValueError: q / K/V not one bf16 or f16 dtype, D % 64 nonzero or D > 256,
    Tq % (2 block_q), Tk % block_kv or Hq % Hkv nonzero."""
    Tq, Hq, D = q.shape
    Tk, Hkv, _ = k_buf.shape
    dtype = q.dtype
    if dtype not in (jnp.bfloat16, jnp.float16) or k_buf.dtype != dtype or D % 64 or D > 256:
        raise ValueError(f"varlen_attention: bf16/f16 q and K/V with D % 64 == 0, D <= 256, got "
                         f"{q.dtype}/{k_buf.dtype} D={D}")
    if Tq % (2 * cfg.block_q) or Tk % cfg.block_kv or Hq % Hkv:
        raise ValueError(f"varlen_attention: Tq={Tq}, Tk={Tk}, Hq={Hq}, Hkv={Hkv} vs {cfg}")
    mcs = cfg.max_concurrent_steps
    tf = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))

    def entry(rows_ref, tiles_ref, pairs_ref, q_ref, k_ref, v_ref, out_ref):
        pl.run_scoped(
            lambda *scoped: _kernel(rows_ref, tiles_ref, pairs_ref, q_ref, k_ref, v_ref,
                                    out_ref, scoped, cfg=cfg, G=Hq // Hkv, D=D,
                                    c_log2=scale * math.log2(math.e), dtype=dtype),
            (plgpu.SMEM((2, cfg.block_q, D), dtype, transforms=tf),
             plgpu.SMEM((mcs, cfg.block_kv, D), dtype, transforms=tf),
             plgpu.SMEM((mcs, cfg.block_kv, D), dtype, transforms=tf)),
            (plgpu.Barrier(num_barriers=mcs), plgpu.Barrier(num_barriers=mcs),
             plgpu.Barrier(num_barriers=2)),
            (plgpu.Barrier(num_arrivals=2, num_barriers=mcs),) * 2,
            plgpu.Barrier(num_arrivals=2),
            collective_axes="wg")

    params: dict = {"compiler_params": plgpu.CompilerParams(approx_math=True)}
    if interpret:
        params = {"interpret": plgpu.InterpretGPUParams()}
    return plgpu.kernel(
        entry, out_type=jax.ShapeDtypeStruct(q.shape, dtype),
        grid=(Hq, Tq // (2 * cfg.block_q)), grid_names=("heads", "q_seq"),
        num_threads=3, thread_name="wg", **params,
    )(rows, tiles, pairs, q, k_buf, v_buf)


def paged_prefill_attention_mgpu(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                                 layer: jax.Array | int, block_tables: jax.Array,
                                 seq_lens: jax.Array, positions: jax.Array,
                                 seq_ids: jax.Array, *, scale: float,
                                 window: jax.Array | int = 0, kv_capacity: int | None = None,
                                 config: MgpuPrefillConfig | None = None,
                                 fallback: bool = True, jit: bool = True) -> jax.Array:
    """Same contract as ``paged_prefill_attention_ref`` (bf16 / f16 caches, no FP8 scales),
    on the varlen FlashAttention-3 kernel adapted from JAX's attention_mgpu.py (module doc).

    Raises ValueError (:func:`varlen_attention`) for a cache not bf16 / f16, D % 64 != 0,
    D > 256 or Hq % Hkv != 0 (``paged_prefill_mgpu_supported`` answers the same); with
    the fallback compiled, also the Triton kernel's ``PagedAttention*Error``.
    Args (beyond the reference's): kv_capacity: static size of the gathered K/V buffer in
      tokens (default :func:`default_kv_capacity`: 2 T or the bucket's worst case where
      smaller); where the worst case (:func:`worst_case_context`) exceeds it, contexts summing
      to more take the Triton kernel through ``lax.cond`` (``fallback``) or give wrong rows
      (``fallback=False``: benchmarks that know they fit). Where it cannot be exceeded no cond
      is compiled. jit: run under the module-level :func:`_mgpu_prefill_jit` (one lowering
      per shape in a program; False: inline, the state before it).
    Returns: [T, Hq, D] in q.dtype, zeros for padding tokens.
    """
    cfg = config or MgpuPrefillConfig()
    T = q.shape[0]
    (S, maxp), ps = block_tables.shape, k_cache.shape[3]
    kv_capacity = kv_capacity or default_kv_capacity(T, S, maxp, ps)
    fallback = fallback and worst_case_context(T, S, maxp, ps) > kv_capacity
    static_layer = layer if isinstance(layer, int) else None
    kw = dict(scale=float(scale), kv_capacity=int(kv_capacity), config=cfg, fallback=fallback,
              static_layer=static_layer)
    fn = _mgpu_prefill_jit if jit else _mgpu_prefill
    return fn(q, k_cache, v_cache, None if static_layer is not None else layer, block_tables,
              seq_lens, positions, seq_ids, window, **kw)


def _mgpu_prefill(q, k_cache, v_cache, layer, block_tables, seq_lens, positions, seq_ids,
                  window, *, scale: float, kv_capacity: int, config: MgpuPrefillConfig,
                  fallback: bool, static_layer: int | None) -> jax.Array:
    """:func:`paged_prefill_attention_mgpu` once its static choices are made (``layer`` is
    None when ``static_layer`` gives it)."""
    cfg = config
    if static_layer is not None:
        layer = static_layer
    T = q.shape[0]
    k_buf, v_buf, rows, tiles, pairs, fits = plan(
        k_cache, v_cache, layer, block_tables, seq_lens, positions, seq_ids, window,
        kv_capacity=kv_capacity, cfg=cfg)
    Tq = rows.shape[1]

    def fast(q):
        qp = jnp.pad(q, ((0, Tq - T), (0, 0), (0, 0))).astype(k_buf.dtype)
        o = varlen_attention(qp, k_buf, v_buf, rows, tiles, pairs, scale=scale, cfg=cfg)[:T]
        return jnp.where((seq_ids >= 0)[:, None, None], o, 0).astype(q.dtype)

    if not fallback:
        return fast(q)

    def slow(q):
        return paged_prefill_attention(q, k_cache, v_cache, layer, block_tables, seq_lens,
                                       positions, seq_ids, scale=scale, window=window)
    return lax.cond(fits, fast, slow, q)


# One traced / lowered function per shape and static choice, shared by the unrolled layers.
_mgpu_prefill_jit = jax.jit(_mgpu_prefill, static_argnames=(
    "scale", "kv_capacity", "config", "fallback", "static_layer"))
