"""Plain-jnp references for the matmul kernels (the functions every kernel is checked against).

Weight layout used by the kernels ("prepared" layout): ``w_nk`` is ``[N, K]`` (out, in), i.e.
the transpose of the engine's canonical ``[K, N]`` (``x @ w``) layout, with K contiguous. That
is the layout Hopper's FP8 wgmma needs for its B operand (K-major) and the layout a decode GEMV
reads with long contiguous rows. A fused gate+up weight is ``[2F, K]``: rows ``[0, F)`` are the
gate projection, rows ``[F, 2F)`` the up projection.

FP8 scaling (vLLM / TensorRT-LLM "per-channel weight, per-token activation" scheme):
``w ≈ w_fp8[n, k] * w_scale[n]`` and ``x ≈ x_fp8[m, k] * x_scale[m]``, so
``(x @ w.T)[m, n] = x_scale[m] * w_scale[n] * sum_k x_fp8[m, k] * w_fp8[n, k]`` — the scales are
applied once, to the float32 accumulator, in the epilogue. Block-FP8 checkpoints (DeepSeek-V3,
Qwen3-FP8) carry per-group weight scales instead, ``w ≈ w_fp8[n, k] * w_scale[n, k // g]``
(``w_scale [N, K / g]``): see :func:`grouped_linear_ref` (W8A16 only).
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
    ``scale = max(|a_row|, MIN_ABSMAX) / 448`` (all-zero rows: a tiny finite scale). Values
    are rounded to nearest by the dtype conversion. Leading dims beyond R pass through
    ([..., C] -> scale [...]). No checks, no errors. vLLM's dynamic per-token FP8 quant.
    """
    af = a.astype(jnp.float32)
    amax = jnp.maximum(jnp.max(jnp.abs(af), axis=-1), MIN_ABSMAX)
    scale = amax / FP8_MAX
    q = jnp.clip(af / scale[..., None], -FP8_MAX, FP8_MAX).astype(FP8)
    return q, scale.astype(jnp.float32)


def quantize_row_groups_fp8(a: jax.Array, group: int) -> tuple[jax.Array, jax.Array]:
    """Absmax quantization of each ``group`` consecutive columns of each row of ``a [R, C]``
    to float8_e4m3fn (DeepSeek-V3's 1 x 128 activation tiles; vLLM
    ``per_token_group_quant_fp8``): ``(q [R, C], scale [R, C / group] f32)`` with
    ``a[r, c] ≈ q[r, c] * scale[r, c // group]``. Raises ValueError if group does not divide C.
    """
    R, C = a.shape
    if C % group:
        raise ValueError(f"quantize_row_groups_fp8: group {group} does not divide {C} columns")
    q, s = quantize_rows_fp8(a.reshape(R * (C // group), group))
    return q.reshape(R, C), s.reshape(R, C // group)


def linear_ref(x: jax.Array, w_nk: jax.Array, w_scale: jax.Array | None = None,
               x_scale: jax.Array | None = None,
               out_dtype: jnp.dtype | None = None) -> jax.Array:
    """``out[m, n] = x_scale[m] * w_scale[n] * sum_k x[m, k] * w_nk[n, k]`` in float32.

    Args:
      x: [M, K] bf16/f32, or float8_e4m3fn with ``x_scale`` [M] f32 (per token) or [M, G]
        (per token and group of K / G columns: each group's dot is scaled by its own scale).
      w_nk: [N, K] bf16/f32, or float8_e4m3fn with ``w_scale`` [N] f32.
      out_dtype: result dtype (default: ``x.dtype``, or bf16 when x is FP8).
    Returns:
      [M, N] in ``out_dtype``.
    Raises:
      TypeError: only from jnp (no checks of its own), e.g. K of x and w_nk differ.
    """
    xf, wf = x.astype(jnp.float32), w_nk.astype(jnp.float32)
    if x_scale is not None and x_scale.ndim == 2:
        (M, K), G = x.shape, x_scale.shape[1]
        acc = jnp.einsum("mgk,ngk,mg->mn", xf.reshape(M, G, K // G),
                         wf.reshape(-1, G, K // G), x_scale.astype(jnp.float32),
                         precision=jax.lax.Precision.HIGHEST)
    else:
        acc = jnp.dot(xf, wf.T, precision=jax.lax.Precision.HIGHEST)
    if x_scale is not None and x_scale.ndim == 1:
        acc = acc * x_scale.astype(jnp.float32)[:, None]
    if w_scale is not None:
        acc = acc * w_scale.astype(jnp.float32)[None, :]
    if out_dtype is None:
        out_dtype = jnp.bfloat16 if x.dtype == FP8 else x.dtype
    return acc.astype(out_dtype)


# Below this many rows grouped_linear_ref runs one dot per group of K (the FP8 weight read
# once, partial sums scaled); above it the weight is dequantized first.
GROUPED_DOT_MAX_M = 16


def grouped_linear_ref(x: jax.Array, w_nk: jax.Array, w_scale: jax.Array,
                       out_dtype: jnp.dtype | None = None) -> jax.Array:
    """W8A16 with per-group weight scales: ``out[m, n] = sum_k x[m, k] * w[n, k] * s[n, k // g]``
    (block-FP8 checkpoints: DeepSeek-V3, Qwen3-FP8). No checks: bad shapes fail in jnp.

    Args:
      x: [M, K] bf16/f32 activations.
      w_nk: [N, K] float8_e4m3fn (or any float) weight.
      w_scale: [N, G] f32 with ``g = K / G`` input columns per scale.
    Returns:
      [M, N] in ``out_dtype`` (default ``x.dtype``). For M <= GROUPED_DOT_MAX_M the weight is
      widened to ``x.dtype`` inside one small dot per group and each group's float32 partial
      sums are scaled; for larger M it is dequantized to ``x.dtype`` first (one rounding).
    """
    M, K = x.shape
    N, G = w_scale.shape
    g = K // G
    out_dtype = out_dtype or x.dtype
    if M <= GROUPED_DOT_MAX_M:
        part = jnp.einsum("mgk,ngk->mgn", x.reshape(M, G, g), w_nk.astype(x.dtype).reshape(N, G, g),
                          preferred_element_type=jnp.float32)
        return jnp.einsum("mgn,ng->mn", part, w_scale.astype(jnp.float32)).astype(out_dtype)
    w = (w_nk.astype(jnp.float32).reshape(N, G, g) * w_scale[:, :, None]).reshape(N, K)
    return jax.lax.dot_general(x, w.astype(x.dtype), (((1,), (1,)), ((), ())),
                               preferred_element_type=jnp.float32).astype(out_dtype)


def silu_mul_ref(gate_up: jax.Array, out_dtype: jnp.dtype | None = None) -> jax.Array:
    """SwiGLU activation (Shazeer 2020): ``silu(g) * u`` for ``gate_up = [g | u]`` ([M, 2F]
    -> [M, F]), in float32, cast to ``out_dtype`` (default gate_up's dtype). An odd last dim
    fails in jnp (TypeError)."""
    f = gate_up.shape[-1] // 2
    g = gate_up[..., :f].astype(jnp.float32)
    u = gate_up[..., f:].astype(jnp.float32)
    return (jax.nn.silu(g) * u).astype(out_dtype or gate_up.dtype)


def gate_up_ref(x: jax.Array, w_nk: jax.Array, w_scale: jax.Array | None = None,
                x_scale: jax.Array | None = None,
                out_dtype: jnp.dtype | None = None) -> jax.Array:
    """Fused gate+up projection with SwiGLU: ``silu(x @ Wg.T) * (x @ Wu.T)``.

    ``w_nk`` is ``[2F, K]`` (gate rows first); returns [M, F] in ``out_dtype`` (default as
    :func:`linear_ref`). x, scales and errors as :func:`linear_ref`.
    The product is formed in float32 before the single rounding to ``out_dtype``.
    """
    acc = linear_ref(x, w_nk, w_scale, x_scale, out_dtype=jnp.float32)
    if out_dtype is None:
        out_dtype = jnp.bfloat16 if x.dtype == FP8 else x.dtype
    return silu_mul_ref(acc, out_dtype)
