"""Order-preserving uint32 keys of float32 values, for the on-device sampler.

``order_key`` maps float32 onto uint32 so that the order of the keys is the order of the
floats (-0.0 and +0.0 share a key): :func:`jaxinfer.sampling_topk.sorted_best` sorts by these
keys, and the threshold searches of :mod:`jaxinfer.sampling_filters` (and their Pallas kernels,
``pallas_kernels/sampling``) narrow a bracket of keys instead of a bracket of floats.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_U32 = jnp.uint32


def order_key(x: jax.Array) -> jax.Array:
    """float32 -> uint32 with ``a < b  <=>  key(a) < key(b)`` for non-NaN floats (-0.0 -> +0.0)."""
    x = jnp.where(x == 0, jnp.zeros_like(x), x)
    b = jax.lax.bitcast_convert_type(x, _U32)
    return jnp.where((b >> 31) == 1, ~b, b | _U32(0x80000000))


def key_value(k: jax.Array) -> jax.Array:
    """Inverse of :func:`order_key`: uint32 key -> float32 (anything equal to 0 -> +0.0).

    A backend that treats subnormals as zero (XLA:CPU) lets a search end on a subnormal key
    that compares equal to 0; it comes back as 0.
    """
    b = jnp.where((k >> 31) == 1, k & _U32(0x7FFFFFFF), ~k)
    v = jax.lax.bitcast_convert_type(b, jnp.float32)
    return jnp.where(v == 0, jnp.zeros_like(v), v)
