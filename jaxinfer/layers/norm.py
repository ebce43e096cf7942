"""RMSNorm (Zhang & Sennrich 2019), computed in float32 as HF transformers does."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """``x * rsqrt(mean(x**2) + eps) * weight`` over the last axis.

    Args:
      x: [..., H] activations (any float dtype). weight: [H] multiplicative weight (Gemma's
        ``1 + w`` already folded in). eps: added to the mean square.
    Returns:
      [..., H] in x.dtype; the statistics are taken in float32.
    """
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * weight.astype(jnp.float32)).astype(x.dtype)
