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

# Named variants (kernel keyword arguments). "cvt" is the measured default; the others are
# candidates until an H200 run of ``bench_paged_attention.py --fp8-sweep`` says otherwise.
FP8_DECODE_VARIANTS: dict[str, dict] = {
    "cvt": {},
    "bits": {"fp8_widen": "bits"},
    "qk8": {"fp8_dots": "qk"},
    "qk8_bits": {"fp8_dots": "qk", "fp8_widen": "bits"},
    "qk8_pv8": {"fp8_dots": "qk_pv"},
}
FP8_DECODE_DEFAULT = "cvt"
ENV_VARIANT = "JAXINFER_FP8_DECODE"  # overrides FP8_DECODE_DEFAULT, for end-to-end trials


def fp8_decode_config(variant: str | None = None) -> tuple[str, str]:
    """``(fp8_widen, fp8_dots)`` of the named variant; None: ``$JAXINFER_FP8_DECODE`` if set,
    else :data:`FP8_DECODE_DEFAULT`. The decode kernel calls this when its caller (the
    engine's fp8-KV decode path) leaves both options unset.

    Raises:
      ValueError: an unknown variant name.
    """
    name = variant or os.environ.get(ENV_VARIANT) or FP8_DECODE_DEFAULT
    if name not in FP8_DECODE_VARIANTS:
        raise ValueError(f"unknown FP8 decode variant {name!r}; one of {list(FP8_DECODE_VARIANTS)}")
    kw = FP8_DECODE_VARIANTS[name]
    return kw.get("fp8_widen", "cvt"), kw.get("fp8_dots", "none")


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
