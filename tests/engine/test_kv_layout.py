"""The KV pool as one array per layer (unrolled models) against the stacked pool: the same
writes, reads and page copies, on fresh random inputs (jaxinfer.layers.attention.KVCache)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.layers.attention import AttentionBackend, AttentionMetadata, allocate_kv_cache
from jaxinfer.layers.page_copy import copy_pages

L, HKV, HQ, P, PS, D = 3, 2, 4, 12, 4, 8


def _layers(cache) -> list[np.ndarray]:
    """[L] of [Hkv, P, ps, D] float32 for either layout."""
    if cache.per_layer:
        return [np.asarray(a[0], np.float32) for a in cache.k]
    return [np.asarray(cache.k[i], np.float32) for i in range(cache.k.shape[0])]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float8_e4m3fn])
def test_per_layer_pool_matches_the_stacked_pool(dtype) -> None:
    rng = np.random.default_rng(7)
    stacked = allocate_kv_cache(L, HKV, P, PS, D, dtype)
    split = allocate_kv_cache(L, HKV, P, PS, D, dtype, per_layer=True)
    assert split.per_layer and not stacked.per_layer
    assert split.dtype == stacked.dtype == jnp.dtype(dtype) and split.num_pages == P
    assert len(split.k) == L and split.k[0].shape == (1, HKV, P, PS, D)
    attn = AttentionBackend()
    # Two sequences of 5 and 7 tokens in pages [3, 7] and [9, 2], prefilled layer by layer.
    lens = np.array([5, 7], np.int32)
    tables = np.array([[3, 7], [9, 2]], np.int32)
    pos = np.concatenate([np.arange(n) for n in lens]).astype(np.int32)
    seq = np.repeat(np.arange(2), lens).astype(np.int32)
    slots = tables[seq, pos // PS] * PS + pos % PS
    md = AttentionMetadata(positions=jnp.asarray(pos), slot_mapping=jnp.asarray(slots),
                           seq_ids=jnp.asarray(seq), block_tables=jnp.asarray(tables),
                           seq_lens=jnp.asarray(lens), logits_indices=jnp.asarray(lens - 1),
                           is_prefill=True)
    T = int(lens.sum())
    for layer in range(L):
        q, k, v = (jnp.asarray(rng.standard_normal((T, h, D)), jnp.float32)
                   for h in (HQ, HKV, HKV))
        out_s, stacked = attn(q, k, v, stacked, jnp.int32(layer), md, scale=D ** -0.5,
                              window=jnp.int32(0))
        out_p, split = attn(q, k, v, split, layer, md, scale=D ** -0.5, window=jnp.int32(0))
        np.testing.assert_array_equal(np.asarray(out_p), np.asarray(out_s))
    for a, b in zip(_layers(split), _layers(stacked)):
        np.testing.assert_array_equal(a, b)
    assert np.abs(_layers(split)[L - 1][:, 9]).sum() > 0  # the writes landed
    # Copy-on-write of pages 3 -> 5 and 9 -> 11 (count 2 of 3 entries) in both layouts.
    src, dst = jnp.asarray([3, 9, 7], jnp.int32), jnp.asarray([5, 11, 0], jnp.int32)
    stacked = copy_pages(stacked, src, dst, jnp.int32(2))
    split = copy_pages(split, src, dst, jnp.int32(2))
    for a, b in zip(_layers(split), _layers(stacked)):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a[:, 5], a[:, 3])
        np.testing.assert_array_equal(a[:, 11], a[:, 9])
        assert not np.array_equal(a[:, 0], a[:, 7])  # past count: not copied
    assert jax.tree.structure(split) != jax.tree.structure(stacked)
