"""Shape checks, option resolution and launch heuristics of the paged decode kernel
(decode.py): which shapes the kernel takes, the split-K count, tokens a step, the FP8
variant's options filled in, and the exact log-sum-exp merge of split partials (XLA).

Measurements behind the defaults: benchmarks/kernels/NOTES_paged_attention.md.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from pallas_kernels.paged_attention.errors import (
    PagedAttentionShapeError,
    PagedAttentionUnsupportedError,
    check_q_and_cache,
)
from pallas_kernels.paged_attention.fp8 import check_variant, fp8_decode_config

LOG2E = math.log2(math.e)
KV_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32, jnp.float8_e4m3fn)
NUM_SMS_H200 = 132
LAYOUTS = ("qk", "kq")
# Splits of at most this many steps run straight-line (decode.py's `unroll`). H200, session 18
# (NOTES_paged_attention "Straight-line splits"): at B = 1 (1-2 steps a split) 0.1-0.6 us less
# per call (CUPTI: ctx 1024 5.5 -> 5.1, ctx 2048 8.3 -> 7.7-7.8, ctx 4096 10.3 -> 10.1-10.2,
# FP8 ctx 2048 6.3 -> 6.1, ctx 4096 9.4 -> 9.1); 4 steps straight-line were slower (B1
# ctx 8192 14.2 -> 15.6, B8 ctx 1024 13.2 -> 15.0), so 2.
DEFAULT_UNROLL = 2
# Triton software-pipelining depth for 16-bit KV: 5 stages keep two K/V buffers a program
# (the block-table load is stage 0, K/V stage 1: NOTES_paged_attention "Design"; ~72 KB of
# shared memory at D 128, 3 programs an SM), 4 keep one (the load of step i+1 waits for step
# i's math, but more programs share an SM). H200, session 19 (8B heads, D 128, CUPTI us a
# call, records paged_small_batch_h200_s19call{1,2}): once the grid exceeds the 3 x 132
# programs that two buffers leave resident, one buffer wins -- B64 ctx2048 / 4096 143.7 /
# 283.6 -> 123.8 / 241.2, B128 ctx1024 / 2048 / 4096 128.6 / 249.8 / 493.3 -> 125.3 / 242.4
# / 477.1, B256 ctx2048 475.5 / 477.4 (even); within it two buffers win (B32 ctx2048 64.8 vs
# 70.3, B48 95.0 / 95.1). FP8 caches keep 5 (kq8_bt64_w2 at B128: 155 vs 223 with 4).
# Session 20 (records paged_small_batch_h200_s20call1: psb_d64 / psb_d256): at D 64 (Hq 32,
# Hkv 8) the same crossing -- B64 ctx2048 (512 programs) 75.8 -> 66.0 with 4 stages, B128 130.0
# -> 127.4, B32 (256) 35.1 vs 39.6 -- so D 64 follows the rule; at D 256 (Hq 16, Hkv 8) 4
# stages never paid (B16 65.2 vs 76.6, B32 / B64 within 1 %): D 256 and the rest keep 5.
STAGES_HEAD_DIMS = (64, 128)
STAGES_TWO_BUFFERS = 5
STAGES_MANY_PROGRAMS = 4
RESIDENT_TWO_BUFFERS = 3  # programs an SM with two K/V buffers (D 128, 4 warps)


# 16-bit caches at head dim 256 (Gemma 3), session 21 (H200, CUPTI us a call, record
# paged_small_batch_h200_s21call4, stock / default / candidate): while the grid splits (16 to
# SPLIT_MAX_GROUPS (row, KV head) groups), 32-token steps -- 4/1/256 ctx2048 B16 / B64 / B128
# 28.6 / 15.4 / 14.4, 88.1 / 41.6 / 38.0, 158.0 / 72.0 / 68.2, B16 ctx8192 77.9 / 42.9 / 38.9;
# 16/8/256 B4 / B16 50.8 / 25.1 / 21.8, 153.9 / 71.6 / 67.6 -- but not past it (16/8/256 B64
# 250.3 vs 303.2) nor below 16 groups (4/1/256 B1 / B4 6.8 vs 7.9, 8.7 vs 10.9). Below 8
# groups 8 warps: 4/1/256 B1 12.6 / 6.8 / 6.2 (B4 8.7 either way). Call 5, new vs old in two
# processes (record paged_small_batch_h200_s21call5): 4/1/256 B16 / B64 / B128 14.3 / 37.5 /
# 68.1 vs 15.4 / 42.0 / 71.7 (2.00x / 2.34x / 2.33x stock), B1 6.4 vs 6.6 (2.02x), B4 8.7 =
# 8.7; 16/8/256 B2 / B4 / B16 13.7 / 21.8 / 68.0 vs 14.6 / 25.3 / 70.6; 8 warps at 8 groups
# split (4/1/256 B8 11.2 vs 11.5, 16/8/256 B1 10.6 vs 10.0), so 8 warps only below 8.
WIDE_HEAD_DIM = 256
WIDE_BT32_MIN_GROUPS = 16
WIDE_W8_BELOW_GROUPS = 8


def _pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _merge_splits(o_part: jax.Array, lse: jax.Array, dtype) -> jax.Array:
    """Exact log-sum-exp merge: o_part [B, Hkv, S, G, D] f32, lse [B, Hkv, S, G] (log2)."""
    B, Hkv, _, G, D = o_part.shape
    mx = lse.max(axis=2, keepdims=True)
    mx = jnp.where(jnp.isneginf(mx), 0.0, mx)
    w = jnp.exp2(lse - mx)  # 0 for empty splits
    den = w.sum(axis=2)
    num = (w[..., None] * o_part).sum(axis=2)
    o = jnp.where((den > 0)[..., None], num / jnp.where(den > 0, den, 1.0)[..., None], 0.0)
    return o.reshape(B, Hkv * G, D).astype(dtype)


# choose_num_splits splits (B x Hkv) groups up to this many; one split above. Session 16 set
# ~0.9 of the SMs (118); session 20 (H200, record paged_small_batch_h200_s20call4, CUPTI us a
# call) measured B16 x 8 KV heads (128 groups, one program an SM) with 2 splits and the merge
# in the kernel: ctx2048 36.4-37.0 vs 37.6 at one split, ctx4096 66.3-66.8 vs 69.3 (1.96x ->
# 2.04x stock); B24 (192 groups) is best at one split (51.9 vs 52.1-53.9). Call 5, new vs
# old default in two processes: B16 ctx4096 66.0 vs 69.6 (2.06x stock), ctx2048 37.1 vs 37.5.
SPLIT_MAX_GROUPS = NUM_SMS_H200
# wave_num_splits' tolerance: FlashAttention's 0.85 (session 20 measures 0.85 / 0.95 on the H200)
WAVE_KEEP = 0.85


def wave_num_splits(groups: int, num_blocks: int, slots: int, max_splits: int = 64,
                    keep: float | None = None) -> int:
    """Split-K count by wave efficiency, FlashAttention's ``num_splits_heuristic``
    (flash-attention, csrc/flash_attn/flash_api.cpp): with ``groups`` programs a split
    (batch x KV heads) and ``slots`` programs running at once (resident an SM x SMs), a split
    count ``s`` fills ``w = groups * s / slots`` waves at efficiency ``w / ceil(w)``; the
    smallest ``s`` within ``keep`` (default :data:`WAVE_KEEP`) of the best efficiency wins
    (fewer splits, less merging).
    Only counts that change the steps a split (``ceil(num_blocks / s)``) are eligible; no
    split once the groups alone fill 80 % of the slots. E.g. 528 slots (4 programs an SM):
    48 rows x 8 KV heads -> 4 splits (1536 programs, 2.9 waves; 2 splits would be 1.45)."""
    if groups >= 0.8 * slots:
        return 1
    top = max(1, min(max_splits, num_blocks))
    eligible = [s for s in range(1, top + 1)
                if s == 1 or -(-num_blocks // s) != -(-num_blocks // (s - 1))]
    eff = {s: groups * s / slots / math.ceil(groups * s / slots) for s in eligible}
    best = max(eff.values())
    keep = WAVE_KEEP if keep is None else keep
    return next(s for s in eligible if eff[s] >= keep * best)


def choose_num_splits(batch: int, num_kv_heads: int, num_blocks: int,
                      target_programs: int | None = None, wave_slots: int | None = None
                      ) -> int:
    """Split-K count so that ``batch * Hkv * splits`` reaches ``target_programs``, or (with
    ``wave_slots``, programs that run at once) by :func:`wave_num_splits`.

    Default (measured on an H200, see the notes): no split once ``batch * Hkv`` programs
    exceed one wave of the 132 SMs (:data:`SPLIT_MAX_GROUPS`; the merge costs more than it
    gains); for mid-size batches (32 <= B * Hkv <= 132) as many splits as keep the grid
    within two programs an SM (``floor(264 / (B * Hkv))``: 2 at B = 16, 4 at B = 8, 5 at
    B = 6, 8 at B = 4 with 8 KV heads; session 16 measured 3-25 % less time than the one-wave
    count it replaced, which left 60 SMs with two programs and 72 with one at B = 8; session
    20 measured B = 16); two waves' worth below that (B = 1).
    """
    programs = batch * num_kv_heads
    two_waves = 2 * NUM_SMS_H200
    if target_programs is None and wave_slots is not None:
        return wave_num_splits(programs, num_blocks, wave_slots)
    if target_programs is not None:
        want = -(-target_programs // programs)
    elif programs > SPLIT_MAX_GROUPS:
        return 1
    elif programs >= 32:
        want = two_waves // programs
    else:
        want = -(-two_waves // programs)
    return max(1, min(want, num_blocks))


def default_num_stages(kv_dtype, head_dim: int, programs: int) -> int:
    """Triton ``num_stages`` of a decode launch whose caller left it unset:
    :data:`STAGES_MANY_PROGRAMS` for a 16-bit cache at a head dim in
    :data:`STAGES_HEAD_DIMS` whose grid (``programs`` = batch x KV heads x splits) exceeds
    :data:`RESIDENT_TWO_BUFFERS` programs an SM, else :data:`STAGES_TWO_BUFFERS` (the
    measurements are in the constants' comment)."""
    if (jnp.dtype(kv_dtype).itemsize == 2 and head_dim in STAGES_HEAD_DIMS
            and programs > RESIDENT_TWO_BUFFERS * NUM_SMS_H200):
        return STAGES_MANY_PROGRAMS
    return STAGES_TWO_BUFFERS


def split_grid(batch: int, num_kv_heads: int, max_pages: int, pages_per_step: int,
               num_splits: int | None = None, target_programs: int | None = None,
               wave_slots: int | None = None) -> tuple[int, int]:
    """(splits, pages a split) of a decode launch over a ``max_pages``-wide block table.

    The split count is ``num_splits`` or :func:`choose_num_splits` over the table's steps of
    ``pages_per_step`` pages, at most one step a split; each split then takes a whole number
    of steps (pages a split, a multiple of ``pages_per_step``), and the count is what that
    leaves (ceil(max_pages / pages a split): it can drop, e.g. 33 wanted -> 32).
    """
    n_blocks = -(-max_pages // pages_per_step)
    S = num_splits or choose_num_splits(batch, num_kv_heads, n_blocks, target_programs,
                                        wave_slots)
    pps = -(-n_blocks // max(1, min(S, n_blocks))) * pages_per_step
    return -(-max_pages // pps), pps


def _wide_16bit(kv_dtype, head_dim: int) -> bool:
    """A 16-bit cache at a head dim from :data:`WIDE_HEAD_DIM` (the WIDE_* rules)."""
    return jnp.dtype(kv_dtype).itemsize == 2 and head_dim >= WIDE_HEAD_DIM


def default_block_tokens(head_dim: int, kv_dtype, groups: int | None = None) -> int:
    """Tokens per loop step: K and V tiles of about 16 KB each (64 tokens of bf16 at
    D = 128 measured best on an H200), at least 64 tokens for 2-byte caches, at most 128;
    32 for a 16-bit cache at D >= :data:`WIDE_HEAD_DIM` with :data:`WIDE_BT32_MIN_GROUPS` to
    :data:`SPLIT_MAX_GROUPS` (row, KV head) ``groups`` (the measurements are in the WIDE_*
    constants' comment)."""
    if (groups is not None and _wide_16bit(kv_dtype, head_dim)
            and WIDE_BT32_MIN_GROUPS <= groups <= SPLIT_MAX_GROUPS):
        return 32
    isz = jnp.dtype(kv_dtype).itemsize
    bt = 16384 // (head_dim * isz)
    return min(128, max(bt, 64 if isz <= 2 else 32))


def default_num_warps(kv_dtype, head_dim: int | None, groups: int) -> int:
    """Triton ``num_warps`` of a decode launch whose caller (and FP8 variant) left it unset:
    8 for a 16-bit cache at D >= :data:`WIDE_HEAD_DIM` below :data:`WIDE_W8_BELOW_GROUPS`
    (row, KV head) ``groups``, else 4."""
    if head_dim is not None and _wide_16bit(kv_dtype, head_dim) and groups < WIDE_W8_BELOW_GROUPS:
        return 8
    return 4


def launch_grid(o: dict, kv_dtype, B: int, Hkv: int, max_pages: int, ps: int,
                D: int) -> tuple[int, int, int, int, int]:
    """(tokens a step, pages a step, splits, pages a split, num_stages) of a decode launch with
    the resolved options ``o`` (:func:`_resolve_options`) over a ``max_pages``-wide block
    table of ``ps``-token pages.

    Raises:
      PagedAttentionUnsupportedError: tokens a step not a power of two.
    """
    block_tokens = o["block_tokens"] or default_block_tokens(D, kv_dtype, B * Hkv)
    bt = max(block_tokens, ps, 16 if o["layout"] == "kq" else 1)
    if not _pow2(bt):
        raise PagedAttentionUnsupportedError(
            f"paged_decode_attention: block_tokens={block_tokens} must be a power of two")
    bp = bt // ps
    S, pps = split_grid(B, Hkv, max_pages, bp, o["num_splits"], o["target_programs"],
                        o.get("wave_slots"))
    stages = o["num_stages"] or default_num_stages(kv_dtype, D, B * Hkv * S)
    return bt, bp, S, pps, stages


def _check(q, k_cache, v_cache, block_tables, seq_lens) -> None:
    check_q_and_cache("paged_decode_attention", q, k_cache, v_cache)
    B = q.shape[0]
    if block_tables.ndim != 2 or block_tables.shape[0] != B or seq_lens.shape != (B,):
        raise PagedAttentionShapeError(
            f"paged_decode_attention: block_tables{block_tables.shape} / "
            f"seq_lens{seq_lens.shape} do not match batch {B}")
    if block_tables.dtype != jnp.int32 or seq_lens.dtype != jnp.int32:
        raise PagedAttentionShapeError(
            "paged_decode_attention: block_tables and seq_lens must be int32")


def _kernel_accepts(q_shape: tuple[int, ...], k_cache_shape: tuple[int, ...], kv_dtype) -> bool:
    if len(q_shape) != 3 or len(k_cache_shape) != 5:
        return False
    _, Hq, D = q_shape
    _, Hkv, _, ps, Dk = k_cache_shape
    if D != Dk or Hkv <= 0 or Hq % Hkv or Hq // Hkv > 64:
        return False
    if not (_pow2(D) and 16 <= D <= 256 and _pow2(ps)):
        return False
    return jnp.dtype(kv_dtype) in [jnp.dtype(d) for d in KV_DTYPES]


def paged_decode_attention_supported(q_shape: tuple[int, ...], k_cache_shape: tuple[int, ...],
                                     kv_dtype) -> bool:
    """Whether the engine should dispatch these shapes/dtypes to the kernel (else the ref).

    Needs a power-of-two head dim (16..256) and page size (tokens), Hq a multiple of Hkv with
    at most 64 q heads per KV head, and a bf16 / f16 / float8_e4m3fn cache. (f32 caches also
    run, for tests, but spill registers on the GPU at D = 256 and are not tuned.) Shapes as
    :func:`decode.paged_decode_attention` takes them; other ranks give False (no exception).
    """
    return (_kernel_accepts(q_shape, k_cache_shape, kv_dtype)
            and jnp.dtype(kv_dtype) != jnp.dtype(jnp.float32))


def _resolve_options(kv_dtype, variant: str | None, batch: int = 1, num_kv_heads: int = 1,
                     head_dim: int | None = None, **opts) -> dict:
    """The caller's options, FP8 caches' unset ones filled from the named variant
    (:func:`fp8.fp8_decode_config`, by ``batch`` rows, KV heads and head dim for the
    default), then the defaults (:func:`default_num_warps`; tokens a step stay None for
    :func:`launch_grid`); checked."""
    fp8 = jnp.dtype(kv_dtype) == jnp.dtype(jnp.float8_e4m3fn)
    if fp8:
        for k, v in fp8_decode_config(variant, batch, num_kv_heads, head_dim).items():
            if k not in opts:
                raise ValueError(f"paged_decode_attention: variant option {k!r} unknown")
            if opts[k] is None:
                opts[k] = v
    defaults = {"num_warps": default_num_warps(kv_dtype, head_dim, batch * num_kv_heads),
                "num_stages": None, "fp8_widen": "cvt", "fp8_dots": "none",
                "layout": "qk", "fp8_v_stage": False, "unroll": DEFAULT_UNROLL}
    opts = {k: defaults.get(k) if v is None else v for k, v in opts.items()}
    check_variant(opts["fp8_widen"], opts["fp8_dots"])
    unroll = opts.get("unroll", 0)
    if not isinstance(unroll, int) or unroll < 0:
        raise ValueError(f"paged_decode_attention: unroll={unroll!r} must be an int >= 0")
    if opts["layout"] not in LAYOUTS:
        raise ValueError(f"paged_decode_attention: layout={opts['layout']!r}, one of {LAYOUTS}")
    min_rows = 16 if opts["layout"] == "qk" else 8
    if opts["group_rows"] is None:
        opts["group_rows"] = min_rows
    if not (_pow2(opts["group_rows"]) and opts["group_rows"] >= min_rows):
        raise ValueError(f"paged_decode_attention: group_rows={opts['group_rows']} must be a "
                         f"power of two >= {min_rows} with layout {opts['layout']!r}")
    return opts
