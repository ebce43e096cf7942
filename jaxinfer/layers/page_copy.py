"""Copy-on-write of KV pages on the device (the forked samples of an ``n > 1`` request).

When a request's samples fork, each new sample gets its own copy of the prompt's partial last
page (``block_manager.BlockManager.fork``); :func:`copy_pages` copies those pages inside the
device pool before the step that writes into them. One compiled program per pool: the page
lists have a fixed length C (the engine's ``max_num_seqs``, which bounds the copies of one
step) and a count says how many entries are real, so the program never recompiles and its
cost is proportional to the pages copied, not to C.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp


def copy_pages(cache: Any, src: jax.Array, dst: jax.Array, count: jax.Array) -> Any:
    """Copy page ``src[i]`` into page ``dst[i]`` for every ``i < count``, all layers and KV
    heads, K and V.

    Args:
      cache: a ``layers.attention.KVCache``; ``k``/``v`` [L, Hkv, P, page_size, D] or a
        tuple of per-layer [1, Hkv, P, page_size, D] (any dtype; other fields, such as FP8
        scales, are per layer and stay as they are).
      src / dst: [C] int32 page ids; entries at or past ``count`` are ignored. A ``dst``
        must not be a ``src`` of a later entry (the engine's copies go into fresh pages).
      count: int32 scalar in [0, C].
    Returns:
      the cache with the pages copied (donate ``cache`` for an in-place update).
    """

    def one(i: jax.Array, kv: tuple[Any, Any]) -> tuple[Any, Any]:
        def move(a: jax.Array) -> jax.Array:  # a: [L or 1, Hkv, P, ps, D]
            page = jax.lax.dynamic_slice_in_dim(a, src[i], 1, axis=2)
            return jax.lax.dynamic_update_slice_in_dim(a, page, dst[i], axis=2)

        return jax.tree.map(move, kv)

    k, v = jax.lax.fori_loop(0, jnp.minimum(count, src.shape[0]), one, (cache.k, cache.v))
    return dataclasses.replace(cache, k=k, v=v)
