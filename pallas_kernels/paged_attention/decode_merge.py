"""Split-K paged decode attention in ONE kernel launch: the split merge folded into the kernel.

``paged_decode_attention(..., merge="kernel")`` runs the same grid (B, Hkv, splits) and the
same per-split work as the default (decode.py), but instead of a second launch (the XLA
fusion ``decode_options._merge_splits``), the *last-arriving* split of each (sequence, KV head)
group merges the group's partials (the last-block reduction of NVIDIA's CUDA sample
threadFenceReduction; TensorRT-LLM's multi-block masked MHA counts arrivals per head the
same way):

1. every program writes its f32 partial output ``o_s = acc_s / l_s`` and its base-2
   log-sum-exp ``lse_s`` (``-inf`` for an empty split) to global scratch (two extra outputs
   of the call, never read outside it);
2. a CTA barrier (``plgpu.debug_barrier``: ``gpu.barrier`` -> ``bar.sync``), then one
   ``atomic_add(counter[b, h], 1)``. jax 0.11.2's Pallas Triton lowering emits
   ``tt.atomic_rmw add, acq_rel, gpu``; on a scalar pointer Triton runs it on one thread
   and broadcasts the old value through shared memory with a barrier. The barrier before
   it puts every thread's partial stores before that thread's release in causality order
   (PTX memory model: ``bar.sync`` synchronises the CTA, release is cumulative: the
   pattern of CUDA's cooperative-groups grid sync), so no separate fence is needed; the
   barrier after it orders the other threads' loads after the acquire. Checked on this
   kernel compiled by Triton 3.6 for sm_90 (benchmarks/kernels/triton_static.py's method):
   ``bar.sync; @p atom.global.gpu.acq_rel.add.u32`` in PTX, ``MEMBAR.ALL.GPU; ATOMG.E.ADD.
   STRONG.GPU; CCTL.IVALL`` in SASS (the release fence, the atomic, the L1 invalidation of
   the acquire), plain ``ld.global`` (no ``.nc``) for the partials.
3. the program whose atomic returned ``splits - 1`` reads all partials of its group (plain
   loads: the acquire invalidated this SM's L1, so they come from L2; jax 0.11.2 cannot
   lower ``cache_modifier=".cg"``), merges them exactly as ``_merge_splits`` does
   (``w_s = exp2(lse_s - max lse)``, ``o = sum w_s o_s / sum w_s``, f32; only the
   summation order can differ, i.e. f32 rounding), writes the output in q.dtype, and sets
   its counter back to 0.

Counters must be zero when the kernel starts. JAX/XLA guarantee this way: the counters are
an *input* aliased to an output (``input_output_aliases``): XLA either updates the caller's
buffer in place (when nothing else reads it afterwards) or copies it first, so the kernel
always sees the value of the array passed in. With ``merge_counters=None`` that array is a
fresh ``jnp.zeros`` per call, which XLA materialises (a memset or a small fusion: one more
operation on the stream; what it costs next to the merge fusion it replaces is one of the
things bench_paged_small_batch.py measures).
Because the merging program resets its counter, the counters *returned* are zero again:
a caller can pass ``merge_counters=`` and carry the returned array to the next call (e.g.
through a ``lax.scan`` over layers), so that no zeroing runs per call at all; this relies
only on the kernel's contract "zeros in -> zeros out", not on any state outside JAX. (An
output-only counter buffer, or a persistent counter outside the functional world, would
not be sound: XLA gives no guarantee about an output buffer's initial contents.)

Variants: every Triton variant of decode.py (bf16/f16/f32 and FP8 KV, GQA, static or traced
windows, ``layout="kq"``, the FP8 widening / dot options) works: the merge only reads the
partials the unchanged per-split code writes. With one split there is nothing to merge
and the call is the default kernel's. The Mosaic GPU variant (``fp8_variant="mgpu"``) keeps
its own XLA merge (``merge`` is ignored there).

The Pallas interpreter (CPU tests) runs the programs one after another, so there the last
arriving split is always the last program of its group, no two atomics race, and the
barriers (which it cannot run) are skipped: the interpreter checks the bookkeeping and the
merge, not the memory ordering (a test hook, ``_ARRIVAL_STRIDE``, permutes which split
arrives last).
"""

from __future__ import annotations

import functools
import math
import os

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.paged_attention.errors import PagedAttentionShapeError

MERGES = ("auto", "xla", "kernel")
# merge="auto": "kernel" when B * Hkv <= this, else "xla". H200, 8B heads (Hkv 8), session 9
# (NOTES_paged_attention "The in-kernel merge on the H200"): at B = 1 (8 groups) the kernel
# merge was faster at every context (ctx 1024 / 2048 / 4096 / 32k: 549 / 956 / 1618 / 3446
# vs 491 / 617 / 1439 / 3361 GB/s; FP8 ctx 2048 423 vs 227). Session 16 (NOTES "Split counts
# at B = 4-8"): with choose_num_splits' two-programs-an-SM count, the kernel merge with fresh
# counters beat the XLA merge at B = 4 / 6 / 8 (32-64 groups; bf16 3-13 %, FP8 15-25 %
# less time), where the XLA merge of 4+ splits is two fusions. $JAXINFER_DECODE_MERGE (auto /
# xla / kernel) overrides the default at trace time.
# Session 20 (record paged_small_batch_h200_s20call4): at 96 groups (B12, 2 splits) 29.9
# in the kernel vs 30.3 in XLA; at 128 (B16, 2 splits since session 20) 36.4-37.0 vs 37.6
# (XLA at one split): the bound moves to 128. Call 5 (call5 record), new vs old default: bf16
# B12 29.9 vs 30.4, FP8 B12 / B16 ctx2048 21.2 / 26.6 vs 22.3 / 27.3.
MERGE_KERNEL_MAX_GROUPS = 128
# Chunks the merging program adds straight-line; above, a fori_loop (G * D * S large: e.g.
# G = 8 with 64 splits), which "auto" leaves to the XLA merge (not run on a GPU yet).
MERGE_MAX_UNROLLED_CHUNKS = 4
# Chunks of partials whose loads the merging program issues with the lse load, before the
# reductions over splits (0: after them, as up to session 18). 2 chunks of 8192 f32 is 128
# registers a thread at 4 warps (the main loop's registers are dead by then). H200, session
# 18 call 6 (NOTES_paged_attention "Where a batch-1 call goes"): B1 ctx 1024 / 2048 / 4096 /
# 8192 / 32k 4.96 / 7.68 / 10.12 / 13.92 / 37.52 us vs 5.16 / 7.73 / 10.11 / 14.16 / 37.75.
MERGE_PRELOAD_CHUNKS = 2
# f32 elements of one chunk of partials [C, G, D] the merging program loads at once: 8192 is
# 64 registers a thread at 4 warps (after the main loop, whose registers are free by then);
# 16 splits a chunk for G = 4, D = 128.
MERGE_CHUNK_ELEMS = 8192
# Test hook (interpreter only, programs run in order): program p of a group computes split
# (p * stride) % S, so the last program to arrive is not split S - 1. Needs gcd(stride, S) == 1.
_ARRIVAL_STRIDE = 1


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _chunk_splits(S: int, G: int, D: int) -> int:
    """Splits per chunk of the in-kernel merge (``MERGE_CHUNK_ELEMS`` f32 elements)."""
    Gm, Sp = _next_pow2(G), _next_pow2(S)
    return min(Sp, max(1, 1 << int(math.log2(max(1, MERGE_CHUNK_ELEMS // (Gm * D))))))


def merge_unrolled(S: int, G: int, D: int) -> bool:
    """Whether the in-kernel merge of S splits of G x D runs straight-line (at most
    ``MERGE_MAX_UNROLLED_CHUNKS`` chunks), the form measured on the H200; more chunks take
    a ``fori_loop`` checked only in the interpreter."""
    return -(-S // _chunk_splits(S, G, D)) <= MERGE_MAX_UNROLLED_CHUNKS


def env_merge() -> str:
    """``$JAXINFER_DECODE_MERGE`` (default "auto"). Raises ValueError for a value outside
    :data:`MERGES`."""
    merge = os.environ.get("JAXINFER_DECODE_MERGE", "auto")
    if merge not in MERGES:
        raise ValueError(f"$JAXINFER_DECODE_MERGE={merge!r}: one of {MERGES}")
    return merge


def resolve_merge(merge: str, batch: int, num_kv_heads: int, splits: int, group: int,
                  head_dim: int) -> str:
    """"xla" or "kernel" for ``merge``. "auto": ``$JAXINFER_DECODE_MERGE`` if set, else
    "kernel" when ``batch * num_kv_heads <= MERGE_KERNEL_MAX_GROUPS`` and the merge runs
    straight-line (:func:`merge_unrolled`), "xla" otherwise. Raises ValueError for an
    unknown value."""
    if merge == "auto":
        merge = env_merge()
    if merge == "auto":
        small = batch * num_kv_heads <= MERGE_KERNEL_MAX_GROUPS
        return "kernel" if small and merge_unrolled(splits, group, head_dim) else "xla"
    return merge


def check_merge(merge: str, counters, batch: int, num_kv_heads: int) -> None:
    """Validates ``merge`` and ``merge_counters`` of :func:`decode.paged_decode_attention`.

    Raises:
      ValueError: ``merge`` not in :data:`MERGES`, or counters given with a merge other than
        "kernel" ("auto" too: the caller must know the call returns the counters).
      PagedAttentionShapeError: counters not a [B, Hkv] int32 array.
    """
    if merge not in MERGES:
        raise ValueError(f"paged_decode_attention: merge={merge!r}, one of {MERGES}")
    if counters is None:
        return
    if merge != "kernel":
        raise ValueError("paged_decode_attention: merge_counters needs merge='kernel'")
    if counters.shape != (batch, num_kv_heads) or counters.dtype != jnp.int32:
        raise PagedAttentionShapeError(
            f"paged_decode_attention: merge_counters must be [B, Hkv] = "
            f"[{batch}, {num_kv_heads}] int32 zeros, got {counters.shape} {counters.dtype}")


def _merge_group(o_ref, part_ref, lse_ref, b, h, *, S: int, G: int, D: int) -> None:
    """Merges the S partials of group (b, h) into o_ref[b, h*G : h*G + G] (q.dtype).

    part_ref [B, Hkv, S, G, D] f32 (each split's normalised output), lse_ref [B, Hkv, S, G]
    f32 (its log2-sum-exp, -inf if empty); the math of decode_options._merge_splits.
    """
    Gm, Sp = _next_pow2(G), _next_pow2(S)
    C = _chunk_splits(S, G, D)
    g = jnp.arange(Gm, dtype=jnp.int32)
    col = jnp.arange(D, dtype=jnp.int32)
    gmask = g < G

    def lse_of(s):  # [n, Gm]; -inf past S and G
        m = (s < S)[:, None] & gmask[None, :]
        return plgpu.load(lse_ref.at[b, h, s[:, None], g[None, :]], mask=m, other=-jnp.inf)

    def load_chunk(c0):  # the log2-sum-exps [C, Gm] and partials [C, Gm, D] of c0 ..
        s = c0 + jnp.arange(C, dtype=jnp.int32)
        m = ((s < S)[:, None] & gmask[None, :])[:, :, None]
        o = plgpu.load(part_ref.at[b, h, s[:, None, None], g[None, :, None], col[None, None, :]],
                       mask=m, other=0.0)
        return lse_of(s), o

    n_chunks = -(-S // C)
    straight = n_chunks <= MERGE_MAX_UNROLLED_CHUNKS
    # the first chunks' loads leave with the all-splits lse load, before the max / sum
    # reductions (whose barriers would otherwise hold them back one more round trip)
    early = [load_chunk(i * C) for i in range(min(n_chunks, MERGE_PRELOAD_CHUNKS))
             ] if straight else []
    lse = lse_of(jnp.arange(Sp, dtype=jnp.int32))
    mx = lse.max(axis=0)
    mx = jnp.where(mx == -jnp.inf, 0.0, mx)  # an all-empty group (seq_len 0)
    den = jnp.exp2(lse - mx[None, :]).sum(axis=0)  # [Gm]; empty splits weigh 0

    def add(loaded, num):
        lse_c, o = loaded
        w = jnp.exp2(lse_c - mx[None, :])  # [C, Gm]; 0 for empty splits
        return num + (w[:, :, None] * o).sum(axis=0)

    def chunk(c0, num):  # adds splits c0 .. c0 + C - 1
        return add(load_chunk(c0), num)

    num = jnp.zeros((Gm, D), jnp.float32)
    if straight:  # straight-line: all chunks' loads in flight
        for i in range(n_chunks):
            num = add(early[i], num) if i < len(early) else chunk(i * C, num)
    else:
        num = jax.lax.fori_loop(0, n_chunks, lambda i, n: chunk(i * C, n), num)
    has = den > 0
    o = jnp.where(has[:, None], num / jnp.where(has, den, 1.0)[:, None], 0.0)
    plgpu.store(o_ref.at[b, h * G + g[:, None], col[None, :]], o.astype(o_ref.dtype),
                mask=gmask[:, None])


def _fused_kernel(*refs, decode, n_in: int, S: int, G: int, D: int, interpret: bool) -> None:
    in_refs = refs[:n_in]
    o_ref, part_ref, lse_ref, cnt_ref = refs[n_in:]
    # in_refs[-1] is the zero counters input, the same buffer as cnt_ref (aliased)
    decode(*in_refs[:-1], part_ref, lse_ref)  # this split's partial and log2-sum-exp
    b, h = pl.program_id(0), pl.program_id(1)
    if not interpret:  # the interpreter has no barrier (and runs programs in order)
        plgpu.debug_barrier()  # every thread's partial stores before thread 0's release
    old = plgpu.atomic_add(cnt_ref, (b, h), jnp.ones((), jnp.int32))  # acq_rel, gpu scope
    if not interpret:
        plgpu.debug_barrier()  # the acquire before every thread's loads of the partials

    @pl.when(old == S - 1)  # the last split of (b, h) to arrive
    def _merge():
        _merge_group(o_ref, part_ref, lse_ref, b, h, S=S, G=G, D=D)
        plgpu.store(cnt_ref.at[b, h], jnp.zeros((), jnp.int32))  # zeros in -> zeros out


def merged_call(decode, operands: list, *, B: int, Hkv: int, S: int, G: int, D: int, dtype,
                name: str, compiler_params, interpret: bool,
                counters: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """One launch of grid (B, Hkv, S) whose last-arriving split per group merges.

    Args:
      decode: decode._decode_kernel with its static options bound and ``split_out=True``
        (writes a split's partial [.., S, G, D] f32 and log2-sum-exp [.., S, G]).
      operands: decode's inputs (scalars, block tables, lengths, q, caches).
      B, Hkv, S, G, D: batch, KV heads, splits (> 1), q heads per KV head, head dim.
      dtype: output dtype (q.dtype). name, compiler_params, interpret: of the pallas_call.
      counters: [B, Hkv] int32 zeros, or None for fresh zeros.
    Returns:
      (out [B, Hkv * G, D] dtype, counters [B, Hkv] int32, zero again).
    Raises:
      ValueError: only with the test hook ``_ARRIVAL_STRIDE`` not coprime to S.
    """
    if counters is None:
        counters = jnp.zeros((B, Hkv), jnp.int32)
    if _ARRIVAL_STRIDE != 1:
        if math.gcd(_ARRIVAL_STRIDE, S) != 1:
            raise ValueError(f"_ARRIVAL_STRIDE {_ARRIVAL_STRIDE} must be coprime to {S} splits")
        decode = functools.partial(decode, split_of=lambda p: (p * _ARRIVAL_STRIDE) % S)
    n_in = len(operands) + 1
    f32 = jnp.float32
    out_shape = [jax.ShapeDtypeStruct((B, Hkv * G, D), dtype),
                 jax.ShapeDtypeStruct((B, Hkv, S, G, D), f32),
                 jax.ShapeDtypeStruct((B, Hkv, S, G), f32),
                 jax.ShapeDtypeStruct((B, Hkv), jnp.int32)]
    kernel = functools.partial(_fused_kernel, decode=decode, n_in=n_in, S=S, G=G, D=D,
                               interpret=interpret)
    outs = pl.pallas_call(
        kernel, grid=(B, Hkv, S), out_shape=out_shape, interpret=interpret,
        input_output_aliases={n_in - 1: 3}, compiler_params=compiler_params,
        name=name + "_kmerge",
    )(*operands, counters)
    return outs[0], outs[3]
