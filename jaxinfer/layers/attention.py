"""Attention metadata and the attention backend interface (reference jnp or Pallas kernels).

The model calls :meth:`AttentionBackend.__call__` once per layer with the new tokens' q/k/v;
the backend writes k/v into the paged KV cache (slot mapping) and attends through the block
tables. Backends are plain Python objects chosen at trace time; the kernels they call live in
``pallas_kernels/`` beside their jnp references.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from pallas_kernels.paged_attention import reference as ref


@jax.tree_util.register_dataclass
@dataclass
class AttentionMetadata:
    """Per-step arrays describing where tokens sit in the paged KV cache.

    T is the step's token bucket (prefill: packed tokens of several sequences; decode: one
    token per sequence, T == S), S its sequence bucket, maxp its block-table width.

    Attributes:
      positions: [T] int32 absolute position of each token (0 for padding).
      slot_mapping: [T] int32 ``page * page_size + offset`` where each token's K/V is written;
        padding tokens point into the null page 0.
      seq_ids: [T] int32 row of each token in ``block_tables``; -1 for padding.
      block_tables: [S, maxp] int32 page ids of each sequence (0 = unused / null page).
      seq_lens: [S] int32 context length after this step (0 for padding rows).
      logits_indices: [S] int32 token index whose hidden state gives each row's next-token
        logits (the last scheduled token of the sequence).
    """

    positions: jax.Array
    slot_mapping: jax.Array
    seq_ids: jax.Array
    block_tables: jax.Array
    seq_lens: jax.Array
    logits_indices: jax.Array
    is_prefill: bool = dataclasses.field(metadata=dict(static=True), default=True)


@dataclass(frozen=True)
class KVCache:
    """Device page pool: ``k``/``v`` [L, Hkv, P, page_size, D] (layout in reference.py)."""

    k: jax.Array
    v: jax.Array


jax.tree_util.register_dataclass(KVCache, data_fields=["k", "v"], meta_fields=[])


def allocate_kv_cache(num_layers: int, num_kv_heads: int, num_pages: int, page_size: int,
                      head_dim: int, dtype: jnp.dtype) -> KVCache:
    """Zero-filled page pool of ``2 * L * Hkv * P * ps * D`` elements of ``dtype``."""
    shape = (num_layers, num_kv_heads, num_pages, page_size, head_dim)
    return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))


class AttentionBackend:
    """Writes new K/V into the cache and attends. This base class is the jnp reference.

    Subclasses override :meth:`decode` / :meth:`prefill` / :meth:`write` with kernels and
    fall back to the reference where a kernel does not apply.
    """

    name = "reference"

    def write(self, k_cache: jax.Array, v_cache: jax.Array, layer: jax.Array, k: jax.Array,
              v: jax.Array, slot_mapping: jax.Array) -> tuple[jax.Array, jax.Array]:
        return ref.write_kv_ref(k_cache, v_cache, layer, k, v, slot_mapping)

    def decode(self, q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, layer: jax.Array,
               md: AttentionMetadata, scale: float, window: jax.Array) -> jax.Array:
        return ref.paged_decode_attention_ref(q, k_cache, v_cache, layer, md.block_tables,
                                              md.seq_lens, scale=scale, window=window)

    def prefill(self, q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, layer: jax.Array,
                md: AttentionMetadata, scale: float, window: jax.Array) -> jax.Array:
        return ref.paged_prefill_attention_ref(q, k_cache, v_cache, layer, md.block_tables,
                                               md.seq_lens, md.positions, md.seq_ids,
                                               scale=scale, window=window)

    def __call__(self, q: jax.Array, k: jax.Array, v: jax.Array, cache: KVCache,
                 layer: jax.Array, md: AttentionMetadata, *, scale: float,
                 window: jax.Array) -> tuple[jax.Array, KVCache]:
        """q [T, Hq, D], k/v [T, Hkv, D] -> (attention output [T, Hq, D], updated cache)."""
        kc, vc = self.write(cache.k, cache.v, layer, k, v, md.slot_mapping)
        fn = self.prefill if md.is_prefill else self.decode
        return fn(q, kc, vc, layer, md, scale, window), KVCache(kc, vc)


def get_backend(name: str) -> AttentionBackend:
    """``"reference"``, ``"pallas"``, ``"pallas_decode"`` (decode kernel only) or ``"auto"``
    (Pallas kernels on GPU, else reference).

    ``"pallas"`` off a GPU runs the kernels in Pallas interpret mode (slow; for tests).

    Raises:
      ValueError: for an unknown name.
    """
    if name == "auto":
        name = "pallas" if jax.default_backend() == "gpu" else "reference"
    if name == "reference":
        return AttentionBackend()
    if name in ("pallas", "pallas_decode"):  # pallas_decode: decode kernel, jnp prefill
        from jaxinfer.layers.pallas_attention import PallasAttentionBackend

        return PallasAttentionBackend(interpret=jax.default_backend() != "gpu",
                                      prefill_kernel=name == "pallas")
    raise ValueError(f"unknown attention backend {name!r}; use auto, reference, pallas or "
                     f"pallas_decode")
