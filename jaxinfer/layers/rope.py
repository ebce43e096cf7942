"""Rotary position embeddings (Su et al. 2021, "RoFormer"), HF transformers' half-rotation layout.

Supports plain RoPE, linear scaling and Llama 3's frequency-dependent scaling
(``rope_type == "llama3"``, as in transformers' ``_compute_llama3_parameters``).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.config import ConfigError


def inv_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> np.ndarray:
    """[head_dim // 2] float32 inverse frequencies, after the configured scaling."""
    inv = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if not scaling:
        return inv.astype(np.float32)
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv.astype(np.float32)
    if kind == "linear":
        return (inv / float(scaling["factor"])).astype(np.float32)
    if kind == "llama3":
        factor = float(scaling["factor"])
        lo, hi = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / lo, old_len / hi
        wavelen = 2 * math.pi / inv
        out = np.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_len / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * out / factor + smooth * out
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return np.where(medium, smoothed, out).astype(np.float32)
    raise ConfigError(f"unsupported rope scaling type {kind!r} (supported: linear, llama3)")


def rope_cos_sin(positions: jax.Array, inv_freq: jax.Array) -> tuple[jax.Array, jax.Array]:
    """positions [T] int32 -> cos, sin [T, D] float32 (frequencies repeated twice, HF layout)."""
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [T, H, D] rotated by cos/sin [T, D]: ``x*cos + rotate_half(x)*sin``; in x.dtype."""
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rot = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * cos[:, None, :] + rot * sin[:, None, :]).astype(x.dtype)
