"""FP8 (float8_e4m3fn) quantization utilities for linear layers.

Scheme (as vLLM's ``Fp8LinearMethod`` with per-channel weights / dynamic per-token
activations, and TensorRT-LLM's "FP8 per-channel + per-token" recipe):

* weights, once at load time: symmetric absmax per **output channel** —
  ``w[k, n] ≈ w_fp8[k, n] * scale[n]``, ``scale[n] = max_k |w[k, n]| / 448``;
* activations, every step: symmetric absmax per **token** (row) —
  ``x[m, k] ≈ x_fp8[m, k] * scale[m]``;
* matmul: FP8 × FP8 (W8A8) or bf16 × FP8 (W8A16), float32 accumulation, both scales applied
  to the accumulator in the epilogue, bf16 out.

Weights here use the engine's canonical ``[K, N]`` layout (``x @ w``). The Pallas kernels want
``[N, K]``; see :func:`pallas_kernels.matmul.prepare_weight`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.matmul.reference import FP8, FP8_MAX, linear_ref, quantize_rows_fp8

__all__ = [
    "FP8",
    "FP8_MAX",
    "QuantizationError",
    "dequantize_fp8",
    "fp8_linear_ref",
    "quantize_fp8_per_channel",
    "quantize_fp8_per_token",
]


class QuantizationError(ValueError):
    """An array handed to a quantization function has the wrong rank or dtype."""


def _check_2d(a: jax.Array, what: str) -> None:
    if a.ndim != 2:
        raise QuantizationError(f"{what} must be 2-D, got shape {tuple(a.shape)}")
    if not jnp.issubdtype(a.dtype, jnp.floating) or a.dtype == FP8:
        raise QuantizationError(f"{what} must be a bf16/f16/f32 array, got {a.dtype}")


def quantize_fp8_per_channel(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Quantize a weight ``w [K, N]`` to FP8 with one scale per output channel (column).

    Returns ``(w_fp8 [K, N] float8_e4m3fn, scale [N] float32)`` with
    ``w ≈ w_fp8.astype(f32) * scale``; ``scale[n] = max(max_k |w[k, n]|, 1e-12) / 448``.
    Relative error per element is at most 2^-4 (e4m3 has 3 mantissa bits) for values above
    the subnormal range. Raises :class:`QuantizationError` for a non-2-D or non-float input.
    """
    _check_2d(w, "weight")
    q_t, scale = quantize_rows_fp8(w.T)
    return q_t.T, scale


def quantize_fp8_per_token(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Dynamic per-token quantization of activations ``x [M, K]`` to FP8.

    Returns ``(x_fp8 [M, K] float8_e4m3fn, scale [M] float32)`` with
    ``x ≈ x_fp8 * scale[:, None]``. Runs under jit; XLA fuses it with the producer of ``x``
    (e.g. RMSNorm). Raises :class:`QuantizationError` for a non-2-D or non-float input.
    """
    _check_2d(x, "activation")
    return quantize_rows_fp8(x)


def dequantize_fp8(q: jax.Array, scale: jax.Array, axis: int) -> jax.Array:
    """``q.astype(f32) * scale`` broadcast along ``axis`` (0: per row, 1: per column)."""
    s = scale[:, None] if axis == 0 else scale[None, :]
    return q.astype(jnp.float32) * s


def fp8_linear_ref(x: jax.Array, w_fp8: jax.Array, w_scale: jax.Array, *,
                   act_quant: bool = False) -> jax.Array:
    """Reference FP8 linear layer in float32: ``[M, K] x [K, N] -> [M, N]`` in ``x.dtype``.

    ``w_fp8 [K, N]`` float8_e4m3fn with ``w_scale [N]`` from :func:`quantize_fp8_per_channel`.
    ``act_quant=False`` is W8A16 (x used as is); ``True`` is W8A8 (x quantized per token with
    :func:`quantize_fp8_per_token` first, as the kernels do).
    """
    _check_2d(x, "activation")
    if w_fp8.dtype != FP8:
        raise QuantizationError(f"w_fp8 must be float8_e4m3fn, got {w_fp8.dtype}")
    if act_quant:
        xq, xs = quantize_fp8_per_token(x)
        return linear_ref(xq, w_fp8.T, w_scale, xs, out_dtype=x.dtype)
    return linear_ref(x, w_fp8.T, w_scale, out_dtype=x.dtype)
