"""FP8 (float8_e4m3fn) quantization utilities for linear layers.

Scheme (as vLLM's ``Fp8LinearMethod`` with per-channel weights / dynamic per-token
activations, and TensorRT-LLM's "FP8 per-channel + per-token" recipe):

* weights, once at load time: symmetric absmax per **output channel** —
  ``w[k, n] ≈ w_fp8[k, n] * scale[n]``, ``scale[n] = max_k |w[k, n]| / 448``, rounded to
  nearest even and saturated at ±448 — or, for checkpoints that carry them (DeepSeek /
  Qwen3 128x128 block FP8) and on request (``quantize_params_fp8(..., group_size=g)``), per
  **group** of ``g`` consecutive input rows:
  ``w[k, n] ≈ w_fp8[k, n] * scale[k // g, n]`` (scale ``[K / g, N]``);
* activations, every step: symmetric absmax per **token** (row) —
  ``x[m, k] ≈ x_fp8[m, k] * scale[m]``;
* matmul: FP8 × FP8 (W8A8) or bf16 × FP8 (W8A16), float32 accumulation, both scales applied
  to the accumulator in the epilogue, bf16 out.

Weights here use the engine's canonical ``[K, N]`` layout (``x @ w``). The Pallas kernels want
``[N, K]``; see :func:`pallas_kernels.matmul.prepare_weight`.

Why per-channel is the default of ``quantization="fp8"`` (benchmarks/RESULTS.md, "FP8 weight
quantization accuracy"): e4m3 keeps 3 mantissa bits, so every weight carries a relative
rounding error of up to 2^-4 (about 2.6 % RMS) whatever its scale, and no scale layout brings
SmolLM2 or Gemma 3 270M near 99 % top-1 agreement. Finer groups do help a little, apparently
because each group's absmax is stored exactly (realizations of a layout that keep it exact
keep the gain; ones that move it off the grid lose it): 128-row groups cut mean KL by ~25 %
(+1 point top-1), 32-row groups by ~35-40 %, across three realizations of each layout.
But only the XLA path applies group scales (the Pallas kernels take one scale per output
channel) and their cost on the GPU is not measured yet (benchmarks/kernels/bench_fp8_groups.py
measures it); per-channel runs the W8A16 GEMM measured fastest on an H200. If that benchmark
shows grouped within ~1.1x at decode, set ``DEFAULT_GROUP_SIZE = 128``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.models.params import WeightError, fp8_scale_layout
from pallas_kernels.matmul.reference import FP8, FP8_MAX, linear_ref, quantize_rows_fp8

__all__ = [
    "FP8",
    "FP8_MAX",
    "QuantizationError",
    "dequantize_fp8",
    "dequantize_fp8_weight",
    "fp8_group_size",
    "fp8_linear_ref",
    "fp8_scheme",
    "fp8_weight_linear",
    "quantize_fp8_per_channel",
    "quantize_fp8_per_token",
    "quantize_fp8_weight",
    "quantize_params_fp8",
]

# Group width along K of quantize-on-load (None: one scale per output channel); see above.
DEFAULT_GROUP_SIZE: int | None = None
# Below this many rows a group-scaled GEMM runs one small dot per group and scales the
# partial sums (the FP8 weight is read once); above it the weight is dequantized first.
_GROUPED_DOT_MAX_M = 16


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


def fp8_group_size(K: int, group_size: int | None) -> int | None:
    """Rows per scale group for a ``K``-row weight asked to use ``group_size``-wide groups.

    ``gcd(K, group_size)`` (so groups tile K exactly: SmolLM2's K = 576 gets 64 for 128);
    None (per-channel) when ``group_size`` is None, covers K, or the gcd is below 16.
    """
    if group_size is None:
        return None
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0:
        raise QuantizationError(f"group_size must be a positive integer or None, "
                                f"got {group_size!r}")
    g = math.gcd(K, group_size)
    return None if g >= K or g < 16 else g


def quantize_fp8_weight(w: jax.Array, group_size: int | None = None
                        ) -> tuple[jax.Array, jax.Array]:
    """Quantize a weight ``w [K, N]`` to e4m3 per output channel, or per group of rows.

    Returns ``(w_fp8 [K, N] float8_e4m3fn, scale float32)`` with ``scale`` ``[N]`` (per
    channel: :func:`quantize_fp8_per_channel`) or ``[K / g, N]`` with
    ``g = fp8_group_size(K, group_size)`` and ``w ≈ w_fp8 * scale[k // g, n]``. Each group's
    absmax maps to 448 exactly; values round to nearest even and saturate at ±448.
    Raises :class:`QuantizationError` for a non-2-D or non-float input.
    """
    _check_2d(w, "weight")
    K, N = w.shape
    g = fp8_group_size(K, group_size)
    if g is None:
        return quantize_fp8_per_channel(w)
    # [K, N] -> [N * K/g, g]: one row per (channel, group), quantized as activation rows are.
    rows = jnp.swapaxes(w.reshape(K // g, g, N), 1, 2).reshape(-1, g)
    q, s = quantize_rows_fp8(rows)
    q = jnp.swapaxes(q.reshape(K // g, N, g), 1, 2).reshape(K, N)
    return q, s.reshape(K // g, N)


def _check_scale(q_shape: tuple[int, ...], scale_shape: tuple[int, ...]) -> int | None:
    """Rows per group of a weight ``[..., K, N]`` with ``scale_shape`` (None: per channel)."""
    try:
        return fp8_scale_layout(q_shape, scale_shape)
    except WeightError as e:
        raise QuantizationError(str(e)) from None


def dequantize_fp8_weight(q: jax.Array, scale: jax.Array) -> jax.Array:
    """float32 ``[..., K, N]`` from an e4m3 weight and its per-channel ``[..., N]`` or
    per-group ``[..., G, N]`` scale (exact: every product of an e4m3 value and a float32
    scale is a float32 value up to one rounding). Raises QuantizationError for a scale whose
    shape fits neither layout."""
    g = _check_scale(tuple(q.shape), tuple(scale.shape))
    qf = q.astype(jnp.float32)
    if g is None:
        return qf * scale[..., None, :]
    return qf * jnp.repeat(scale.astype(jnp.float32), g, axis=-2)


def fp8_weight_linear(h: jax.Array, q: jax.Array, scale: jax.Array, *,
                      grouped_dots: bool | None = None) -> jax.Array:
    """W8A16 linear ``h [M, K] @ w [K, N]`` for ``w ≈ q * scale``, in ``h.dtype``.

    The e4m3 weight is widened to ``h.dtype`` inside the GEMM (float32 accumulation).
    Per-channel ``scale [N]`` multiplies the accumulator once. Per-group ``scale [G, N]``:
    with ``grouped_dots`` (default: ``M <= 16``) one dot per group of rows, each partial sum
    scaled, then summed (the weight is read once, as in the per-channel GEMM); otherwise the
    weight is dequantized to ``h.dtype`` first (cost amortized over the rows; one rounding).
    """
    g = _check_scale(tuple(q.shape), tuple(scale.shape))
    if g is None:
        acc = jnp.dot(h, q.astype(h.dtype), preferred_element_type=jnp.float32)
        return (acc * scale).astype(h.dtype)
    M = h.shape[0]
    G, N = scale.shape
    if grouped_dots if grouped_dots is not None else M <= _GROUPED_DOT_MAX_M:
        part = jnp.einsum("mgk,gkn->mgn", h.reshape(M, G, g), q.astype(h.dtype).reshape(G, g, N),
                          preferred_element_type=jnp.float32)
        return jnp.einsum("mgn,gn->mn", part, scale).astype(h.dtype)
    w = dequantize_fp8_weight(q, scale).astype(h.dtype)
    return jnp.dot(h, w, preferred_element_type=jnp.float32).astype(h.dtype)


def fp8_scheme(group_size: int | None = DEFAULT_GROUP_SIZE) -> dict:
    """The quantize-on-load scheme as a JSON-able record (converted checkpoints' manifests
    and cache keys carry it, so a copy made under another scheme is not reused)."""
    return {"method": "fp8", "format": "float8_e4m3fn", "rounding": "nearest-even, saturating",
            "scale": "absmax/448", "group_size": group_size}


def quantize_params_fp8(params: dict, names: Iterable[str],
                        group_size: int | None = DEFAULT_GROUP_SIZE) -> dict:
    """Quantize the stacked projections ``names`` (``[L, K, N]``) of a params dict.

    Returns a new dict where each such ``name`` is float8_e4m3fn ``[L, K, N]`` and
    ``name + "_scale"`` float32 ``[L, N]`` or ``[L, K / g, N]`` (see
    :func:`quantize_fp8_weight`); other entries and projections already in e4m3 are passed
    through. Layers are quantized one at a time from float32 on JAX's default device; the
    result is numpy for numpy input, device arrays otherwise. Deterministic: quantizing the
    same values gives the same bits, whether on load or by ``jaxinfer convert``.
    """
    out = dict(params)
    for name in names:
        w = params[name]
        if w.dtype == FP8:
            continue
        to_np = isinstance(w, np.ndarray)
        qs, ss = [], []
        for i in range(w.shape[0]):
            q, s = quantize_fp8_weight(jnp.asarray(w[i], jnp.float32), group_size)
            qs.append(np.asarray(q) if to_np else q)
            ss.append(np.asarray(s) if to_np else s)
        stack = np.stack if to_np else jnp.stack
        out[name], out[name + "_scale"] = stack(qs), stack(ss)
    return out
