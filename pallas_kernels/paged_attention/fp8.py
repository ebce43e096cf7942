"""FP8 (e4m3fn) KV helpers of the paged decode kernel: the widening and fp8-dot variants.

The decode kernel reads an FP8 cache at half the bytes of bf16 but, measured on an H200
(benchmarks/kernels/NOTES_paged_attention.md), ran at 2.1–2.7 TB/s of fp8 bytes instead of
~4: every 32 KB K/V step carries twice the tokens of a bf16 step, so twice the widening,
MMA and softmax work per byte. The variants below cut that work; each is a kernel option
(``fp8_widen`` / ``fp8_dots`` of :func:`paged_decode_attention`) and a named entry of
:data:`FP8_DECODE_VARIANTS`; the engine's fp8-KV decode path runs :data:`FP8_DECODE_DEFAULT`
(or ``$JAXINFER_FP8_DECODE``), through :func:`fp8_decode_config`.

- ``widen="cvt"`` (the original): ``astype`` to f16 (one ``cvt`` per two values).
- ``widen="bits"``: place the e4m3 bits into an f16 (``s eeee mmm`` -> ``s 0eeee mmm0000000``),
  which is the value times 2^-8, exactly, subnormals included (both formats' subnormals
  scale the same way; Marlin / vLLM ``fp8_marlin`` do this for bf16 with 2^120). The 2^8
  folds into the softmax scale (K) and the output scale (V): integer ops only, no multiply.
- ``dots="qk"``: QK^T as an fp8 x fp8 MMA (f32 accumulate) with q quantized per row
  (scale = max|q_row| / 448, folded into that row's softmax scale): K is never widened.
- ``dots="qk_pv"``: also P V in fp8, P scaled by 2^8 into e4m3 (FlashAttention-3's fp8 path):
  nothing is widened. Less exact: e4m3 keeps 3 mantissa bits of q and of p.

Session-5 H200 result: none of these beat ``cvt``. A Triton 3.6 compile of the lowered kernel
for sm_90 on a CPU machine (NOTES_paged_attention.md, "FP8 KV: static analysis") says why:
the fp8 dots are upcast to f16 anyway (M = 16 rows is too small for wgmma, and sm_90's
mma.sync has no e4m3), and the cost is elsewhere. The ``cvt`` kernel spends 1,196 SASS
instructions a 128-token step (bf16: 485 a 64-token step, the same bytes) and 247 registers
(2 programs an SM; bf16 3): V [tokens, D] is the B operand of P V with tokens as the
reduction axis, and Triton widens the fp8 tile *after* loading it from shared memory in the
MMA operand layout: 128 one-byte ``LDS.U8`` plus packing per thread and step. The options
below cut that (each a kernel keyword and, combined, named entries of the table):

- ``fp8_v_stage=True``: multiply the widened V by the token mask (1 or 0; masked tokens
  are loaded as 0, so the product is exact). An elementwise op with a computed operand keeps
  Triton from moving the widening past the shared-memory load: V is read with 16-byte
  loads, widened, and transposed as an f16 tile through shared memory with ``ldmatrix.trans``
  (bf16 V's path). 128-token step: 1,061 instructions, 164 registers.
- ``layout="kq"``: scores transposed, Sᵀ = K qᵀ [tokens, rows] and Oᵀ = Vᵀ P [D, rows]
  (tokens are the MMA's M side), so the q group is padded to ``group_rows=8`` instead of 16
  (G = 4: half the MMA and softmax work). With the staged V: 805 instructions and 194
  registers a 128-token step; 64-token steps 521 and 116 (4 programs an SM).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp

E4M3_MAX = 448.0
F16_FROM_BITS = 256.0  # 2^(15 - 7): f16's exponent bias minus e4m3's
P_SCALE = 256.0  # p in [0, 1] times 2^8 into e4m3 (keeps p >= 2^-14 normal)

FP8_WIDEN = ("cvt", "bits")
FP8_DOTS = ("none", "qk", "qk_pv")

# Named variants: kernel keyword arguments, filled in where the caller leaves an option None
# (the engine leaves all). "cvt" is the measured default; the others are candidates until an
# H200 run of ``benchmarks/kernels/bench_paged_fp8_sweep.py`` says otherwise. Switching the
# default is the one line FP8_DECODE_DEFAULT.
KQ8 = {"layout": "kq", "group_rows": 8, "fp8_v_stage": True}
FP8_DECODE_VARIANTS: dict[str, dict] = {
    "cvt": {},
    "bits": {"fp8_widen": "bits"},
    "qk8": {"fp8_dots": "qk", "layout": "qk"},
    "qk8_bits": {"fp8_dots": "qk", "fp8_widen": "bits", "layout": "qk"},
    "qk8_pv8": {"fp8_dots": "qk_pv", "layout": "qk"},
    "vstage": {"fp8_v_stage": True},
    "kq8": dict(KQ8, block_tokens=128),
    "kq8_bt64": dict(KQ8, block_tokens=64),
    "kq8_bt64_tp512": dict(KQ8, block_tokens=64, target_programs=512),
    "kq8_bt128_s3": dict(KQ8, block_tokens=128, num_stages=3),
    "kq8_bt64_w8": dict(KQ8, block_tokens=64, num_warps=8),
    "kq8_bt32": dict(KQ8, block_tokens=32),
    "kq16": {"layout": "kq", "group_rows": 16, "fp8_v_stage": True, "block_tokens": 128},
    "kq8_bt64_w2": dict(KQ8, block_tokens=64, num_warps=2),
    # kq8_bt64_w2 split to about 4 programs an SM (its 2-warp programs fit 4 an SM where the
    # default split count aims at 2): session 19, H200 (NOTES_paged_attention "Session 19").
    "kq8_bt64_w2_tp512": dict(KQ8, block_tokens=64, num_warps=2, target_programs=512),
    # kq8_bt64_w2 split by wave efficiency over its 4 programs an SM (decode_options.
    # wave_num_splits, FlashAttention's rule): session 20, H200 (NOTES_paged_attention
    # "Session 20") -- B48 ctx2048 4 splits 69.8 us vs 81.2 at tp512's 2; the other measured
    # batches 16, 32, 64+ get tp512's / kq8_bt64_w2's own counts; below 16 rows it loses.
    "kq8_bt64_w2_waves": dict(KQ8, block_tokens=64, num_warps=2, wave_slots=4 * 132),
    # The two above at 32-token steps: the head-dim-256 default (FP8_WIDE_VARIANTS).
    "kq8_bt32_w2_tp512": dict(KQ8, block_tokens=32, num_warps=2, target_programs=512),
    "kq8_bt32_w2_waves": dict(KQ8, block_tokens=32, num_warps=2, wave_slots=4 * 132),
    # Session 13 (static analysis only, not yet run on a GPU): the transposed layout with both
    # dots FP8 and the group padded to 16 rows, so the dots ask for wgmma
    # (matmul/fp8_fast_accum.py): Sᵀ = K qᵀ (tokens on M = 64 / 128, N = 16) and Oᵀ = Vᵀ P
    # with P x 2^8 in e4m3. Triton 3.6 for sm_90 (B32 ctx2048): both dots on wgmma, no
    # widening left (4 F2FP a step against 66), 87 registers / 36 KB (5 programs an SM) at 64
    # tokens against kq8_bt64's 116 / 52 KB (4), 121 / 69 KB (3) at 128 against kq8's 194 /
    # 101 KB (2); SASS per step about kq8's (551 vs 521, 828 vs 805).
    "kq8w_bt64": {"layout": "kq", "group_rows": 16, "fp8_dots": "qk_pv", "block_tokens": 64},
    "kq8w": {"layout": "kq", "group_rows": 16, "fp8_dots": "qk_pv", "block_tokens": 128},
    # Session 15: the transposed layout with only K q8ᵀ in FP8 (wgmma) and V widened and
    # staged as kq8's (Triton puts that f16 P V on wgmma too, P through one STSM, not kq8w's
    # byte stores). H200: 0.81 / 0.89 of bf16's time (geomean) vs kq8 0.71 — rejected.
    "kq8k_bt64": {"layout": "kq", "group_rows": 16, "fp8_dots": "qk", "block_tokens": 64,
                  "fp8_v_stage": True},
    "kq8k": {"layout": "kq", "group_rows": 16, "fp8_dots": "qk", "block_tokens": 128,
             "fp8_v_stage": True},
}
# The default by batch size (rows of the decode bucket): the fastest variant of the session-6
# H200 sweep (bench_paged_fp8_sweep.py, 8B heads, NOTES_paged_attention.md) at the measured
# batch nearest to it -- B1 ctx32k kq8 0.718x bf16's time (cvt 0.774), B32 ctx2048 cvt 0.707
# (kq8 0.716), B128 ctx1024 / 2048 kq8_bt64_w2 0.626 / 0.610 (cvt 0.720 / 0.671). Boundaries:
# the geometric midpoints of the measured batches, rounded to the decode buckets.
# Session 19 (H200, CUPTI us a call, new vs old default in two processes of one call, record
# paged_small_batch_h200_s19call3): from 4 rows kq8_bt64_w2 split to ~4 programs an SM
# replaces cvt / kq8 at the default two-programs split -- B6 / B8 ctx4096 21.3 / 26.9 vs 24.4
# / 28.6, B8 ctx2048 16.6 vs 18.0, B16 / B32 ctx2048 26.5 / 44.6 vs 28.2-30.0 / 46.8; even at
# B4 ctx4096 (16.9 vs 16.7), B8 ctx1024 (11.8 vs 11.5) and B48 (81.9 vs 81.8).
# Session 20 (H200, CUPTI us a call, the default merge, record
# paged_small_batch_h200_s20call2): from 16 rows the split count by wave efficiency
# (kq8_bt64_w2_waves) -- B24 / B40 / B48 / B56 ctx2048 41.2 / 59.6 / 69.5 / 81.7 vs 48.2 /
# 77.6 / 82.5 / 84.8; the engine at a 48-row bucket 6.76 vs 7.17 ms a step back to back (record
# gpu_decode_records_h200_s20call3); B16 / B32 / B64+ keep their counts. Below 16 rows it
# picked fewer splits and lost (B6 / B8 / B12 23.5 / 17.5 / 23.3 vs 21.5 / 16.6 / 22.3):
# tp512 stays there.
FP8_DECODE_BY_BATCH: tuple[tuple[int, str], ...] = ((16, "kq8_bt64_w2_waves"),
                                                    (4, "kq8_bt64_w2_tp512"), (1, "kq8"))
# Head dim 256 (Gemma 3), session 21 (H200, CUPTI us a call, records
# paged_small_batch_h200_s21call{1,2}): the table's 2-warp, 64-token programs hold a 256-wide
# row in 255 registers and spill (Triton 3.6: 9 at Hq/Hkv 16/8, 129 at Gemma 3's 4/1). From 32
# (row, KV head) groups the same split rules at 32-token steps win -- 16/8/256 ctx2048 B4 / B8 /
# B16 / B32 / B48 / B64 17.6 / 26.7 / 46.3 / 82.0 / 123.7 / 150.9 vs 18.7 / 31.6 / 50.5 / 87.7 /
# 138.6 / 168.9, 4/1/256 B32 19.0 vs 22.4; below 32 groups kq8 (4 warps, 128 tokens) -- 4/1/256
# B4 / B8 / B16 8.0 / 9.5 / 12.0 vs 10.7 / 13.4 / 16.3 (B1 is kq8 already: 7.3). Call 3, new
# vs old default in two processes (paged_small_batch_h200_s21call3): 4/1/256 B4-B128 -9 to -29
# %, 16/8/256 B4 / B16 / B64 / B128 17.5 / 46.6 / 152.3 / 299.7 vs 18.7 / 50.3 / 170.0 / 328.1.
FP8_WIDE_HEAD_DIM = 256
FP8_WIDE_MIN_GROUPS = 32
FP8_WIDE_VARIANTS = {"kq8_bt64_w2_waves": "kq8_bt32_w2_waves",
                     "kq8_bt64_w2_tp512": "kq8_bt32_w2_tp512"}
FP8_WIDE_FEW_GROUPS = "kq8"
FP8_DECODE_DEFAULT = "by_batch"
# Variants served by another kernel than decode.py's: names valid wherever a variant name is
# (``fp8_variant=``, ``$JAXINFER_FP8_DECODE``), opt-in until an H200 run measures them.
# "mgpu": the Mosaic GPU kernel (decode_mgpu.py, TMA page copies + wgmma); shapes it does not
# take fall back to the "by_batch" Triton variant.
FP8_DECODE_OTHER: dict[str, dict] = {"mgpu": {"backend": "mgpu"}}
ENV_VARIANT = "JAXINFER_FP8_DECODE"  # overrides FP8_DECODE_DEFAULT, for end-to-end trials


def env_variant() -> str:
    """The FP8 decode variant in effect: ``$JAXINFER_FP8_DECODE`` if set, else
    :data:`FP8_DECODE_DEFAULT`. Raises ValueError (naming the variable) for an unknown name."""
    name = os.environ.get(ENV_VARIANT) or FP8_DECODE_DEFAULT
    names = ["by_batch", *FP8_DECODE_VARIANTS, *FP8_DECODE_OTHER]
    if name not in names:
        raise ValueError(f"${ENV_VARIANT}={name!r}: one of {names} (unknown FP8 decode "
                         "variant)")
    return name


def variant_for_batch(batch: int, num_kv_heads: int = 1, head_dim: int | None = None) -> str:
    """The :data:`FP8_DECODE_BY_BATCH` variant for ``batch`` rows (the first with
    ``batch >= min_rows``); at head dims from :data:`FP8_WIDE_HEAD_DIM`,
    :data:`FP8_WIDE_FEW_GROUPS` below :data:`FP8_WIDE_MIN_GROUPS` (row, KV head) groups
    (``batch * num_kv_heads``), else the table's variant at 32-token steps
    (:data:`FP8_WIDE_VARIANTS`). ``head_dim`` None: the table alone."""
    name = next((n for min_rows, n in FP8_DECODE_BY_BATCH if batch >= min_rows),
                FP8_DECODE_BY_BATCH[-1][1])
    if head_dim is None or head_dim < FP8_WIDE_HEAD_DIM:
        return name
    if batch * num_kv_heads < FP8_WIDE_MIN_GROUPS:
        return FP8_WIDE_FEW_GROUPS
    return FP8_WIDE_VARIANTS.get(name, name)


def fp8_decode_config(variant: str | None = None, batch: int = 1, num_kv_heads: int = 1,
                      head_dim: int | None = None) -> dict:
    """Kernel keyword arguments of the named variant (a copy); None: ``$JAXINFER_FP8_DECODE``
    if set, else :data:`FP8_DECODE_DEFAULT`; ``"by_batch"``: :func:`variant_for_batch` of
    ``batch`` (the decode call's rows), ``num_kv_heads`` and ``head_dim``. The decode kernel
    fills the options its caller left None (the engine's fp8-KV decode path leaves all) from
    this. Names of
    :data:`FP8_DECODE_OTHER` return ``{"backend": ...}``: the kernel that serves them.

    Raises:
      ValueError: an unknown variant name.
    """
    name = variant or env_variant()
    if name == "by_batch":
        name = variant_for_batch(batch, num_kv_heads, head_dim)
    if name in FP8_DECODE_OTHER:
        return dict(FP8_DECODE_OTHER[name])
    if name not in FP8_DECODE_VARIANTS:
        raise ValueError(f"unknown FP8 decode variant {name!r}; one of "
                         f"{list(FP8_DECODE_VARIANTS) + list(FP8_DECODE_OTHER)}")
    return dict(FP8_DECODE_VARIANTS[name])


def stage_v(v16: jax.Array, valid: jax.Array) -> jax.Array:
    """Widened V [N, D] times the token mask ``valid`` [N] bool (1 or 0, exact: masked tokens
    were loaded as 0). Keeps Triton from widening V after its shared-memory load (see the
    module docstring, ``fp8_v_stage``)."""
    return v16 * valid[:, None].astype(v16.dtype)


def e4m3_bits_to_f16(x: jax.Array) -> jax.Array:
    """float8_e4m3fn -> float16 equal to ``x * 2^-8``, exactly, with integer ops only.

    NaN (0x7F / 0xFF) is not preserved (a saturating KV write stores none).
    """
    # int8 -> int16 sign-extends, so bit 15 is the sign; the 7 magnitude bits move up 7.
    u = jax.lax.bitcast_convert_type(x, jnp.int8).astype(jnp.int16)
    bits = (u & jnp.int16(-32768)) | ((u & jnp.int16(0x7F)) << 7)
    return jax.lax.bitcast_convert_type(bits, jnp.float16)


def quantize_rows_e4m3(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [M, D] float -> (x8 [M, D] float8_e4m3fn, scale [M] f32) with x ~= x8 * scale[:, None].

    Per-row absmax scaling onto e4m3's ±448; all-zero rows get scale 1.
    """
    xf = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(xf), axis=1)
    scale = jnp.where(amax > 0, amax / E4M3_MAX, 1.0)
    x8 = jnp.clip(xf / scale[:, None], -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn)
    return x8, scale


def check_variant(fp8_widen: str, fp8_dots: str) -> None:
    """Raises ValueError for unknown option values."""
    if fp8_widen not in FP8_WIDEN or fp8_dots not in FP8_DOTS:
        raise ValueError(f"fp8_widen={fp8_widen!r} (one of {FP8_WIDEN}) / fp8_dots="
                         f"{fp8_dots!r} (one of {FP8_DOTS})")
