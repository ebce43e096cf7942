"""Plain-jnp references for the matmul kernels (the functions every kernel is checked against).

Weight layout used by the kernels ("prepared" layout): ``w_nk`` is ``[N, K]`` (out, in), i.e.
the transpose of the engine's canonical ``[K, N]`` (``x @ w``) layout, with K contiguous. That
is the layout Hopper's FP8 wgmma needs for its B operand (K-major) and the layout a decode GEMV
reads with long contiguous rows. A fused gate+up weight is ``[2F, K]``: rows ``[0, F)`` are the
gate projection, rows ``[F, 2F)`` the up projection.

FP8 scaling (vLLM / TensorRT-LLM "per-channel weight, per-token activation" scheme):
``w ≈ w_fp8[n, k] * w_scale[n]`` and ``x ≈ x_fp8[m, k] * x_scale[m]``, so
``(x @ w.T)[m, n] = x_scale[m] * w_scale[n] * sum_k x_fp8[m, k] * w_fp8[n, k]`` — the scales are
applied once, to the float32 accumulator, in the epilogue.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
# Smallest absmax a row/channel is scaled from, so all-zero rows get a finite scale.
MIN_ABSMAX = 1e-12


def quantize_rows_fp8(a: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Symmetric absmax quantization of each row of ``a [R, C]`` to float8_e4m3fn.

    Returns ``(q [R, C] float8_e4m3fn, scale [R] float32)`` with ``a ≈ q * scale[:, None]``,
    ``scale = max(|a_row|) / 448``. Values are rounded to nearest by the dtype conversion.
    """
    af = a.astype(jnp.float32)
    amax = jnp.maximum(jnp.max(jnp.abs(af), axis=-1), MIN_ABSMAX)
    scale = amax / FP8_MAX
    q = jnp.clip(af / scale[..., None], -FP8_MAX, FP8_MAX).astype(FP8)
    return q, scale.astype(jnp.float32)


def linear_ref(x: jax.Array, w_nk: jax.Array, w_scale: jax.Array | None = None,
               x_scale: jax.Array | None = None,
               out_dtype: jnp.dtype | None = None) -> jax.Array:
    """``out[m, n] = x_scale[m] * w_scale[n] * sum_k x[m, k] * w_nk[n, k]`` in float32.

    Args:
      x: [M, K] bf16/f32, or float8_e4m3fn with ``x_scale`` [M] f32.
      w_nk: [N, K] bf16/f32, or float8_e4m3fn with ``w_scale`` [N] f32.
      out_dtype: result dtype (default: ``x.dtype``, or bf16 when x is FP8).
    Returns:
      [M, N] in ``out_dtype``.
    """
    acc = jnp.dot(x.astype(jnp.float32), w_nk.astype(jnp.float32).T,
                  precision=jax.lax.Precision.HIGHEST)
    if x_scale is not None:
        acc = acc * x_scale.astype(jnp.float32)[:, None]
    if w_scale is not None:
        acc = acc * w_scale.astype(jnp.float32)[None, :]
    if out_dtype is None:
        out_dtype = jnp.bfloat16 if x.dtype == FP8 else x.dtype
    return acc.astype(out_dtype)


def silu_mul_ref(gate_up: jax.Array, out_dtype: jnp.dtype | None = None) -> jax.Array:
    """SwiGLU activation: ``silu(g) * u`` for ``gate_up = [g | u]`` ([M, 2F] -> [M, F])."""
    f = gate_up.shape[-1] // 2
    g = gate_up[..., :f].astype(jnp.float32)
    u = gate_up[..., f:].astype(jnp.float32)
    return (jax.nn.silu(g) * u).astype(out_dtype or gate_up.dtype)


def gate_up_ref(x: jax.Array, w_nk: jax.Array, w_scale: jax.Array | None = None,
                x_scale: jax.Array | None = None,
                out_dtype: jnp.dtype | None = None) -> jax.Array:
    """Fused gate+up projection with SwiGLU: ``silu(x @ Wg.T) * (x @ Wu.T)``.

    ``w_nk`` is ``[2F, K]`` (gate rows first); returns [M, F]. Scales as :func:`linear_ref`.
    The product is formed in float32 before the single rounding to ``out_dtype``.
    """
    acc = linear_ref(x, w_nk, w_scale, x_scale, out_dtype=jnp.float32)
    if out_dtype is None:
        out_dtype = jnp.bfloat16 if x.dtype == FP8 else x.dtype
    return silu_mul_ref(acc, out_dtype)
