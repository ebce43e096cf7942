"""Gumbel noise for the sampler's Gumbel-max draw: threefry per element, or a counter hash.

The sampler draws a row's token as ``argmax(masked_logits + g)`` with ``g`` i.i.d. standard
Gumbel over the vocabulary (exactly a sample of ``softmax(masked_logits)``). ``DRAW_METHOD``
in :mod:`jaxinfer.sampling` picks how ``g`` is made:

* ``"threefry"`` (:func:`threefry_gumbel`): ``jax.random.gumbel`` of the row's key over the
  whole vocabulary -- [S, V] threefry2x32 evaluations (20 rounds each); at S = 256,
  V = 128256 that is 32.8 M random words, the bulk of the "temperature" variant's ~240-300 us
  on the H200 (benchmarks/RESULTS.md, "Sampling cost");
* ``"hash"`` (:func:`hash_gumbel`): two key words per row from threefry (S evaluations), then
  per element a keyed integer hash of the token id -- a multiply-add and two rounds of
  Wellons' ``lowbias32`` mixer (https://nullprogram.com/blog/2018/07/31/), ~20 integer ops --
  elementwise, so XLA fuses it into the argmax's reduction: no [S, V] noise array is
  written or read. The uniform has 23 bits, as jax.random.uniform's.

Both are functions of (seed, sample index, token id) only: a row's noise does not depend on
the batch it lands in, its row, its bucket or its neighbours. ``"hash"`` gives a different
(equally distributed) stream than ``"threefry"`` for the same seed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_U32 = jnp.uint32
_GOLDEN = 0x9E3779B9  # odd: token id -> id * golden is a bijection of uint32


def row_key(seed: jax.Array, index: jax.Array) -> jax.Array:
    """seed [2] uint32, index int32 -> the row's typed PRNG key
    ``fold_in(fold_in(key(seed[0]), seed[1]), index)``."""
    key = jax.random.key(seed[0])
    key = jax.random.fold_in(key, seed[1])
    return jax.random.fold_in(key, index)


def threefry_gumbel(seeds: jax.Array, index: jax.Array, V: int) -> jax.Array:
    """[S, V] float32 standard Gumbel noise by ``jax.random.gumbel`` of each row's key.

    Args:
      seeds: [S, 2] uint32 per-request seed words.  index: [S] int32 sample index.
      V: vocabulary size.
    """
    keys = jax.vmap(row_key)(seeds, index)
    return jax.vmap(lambda k: jax.random.gumbel(k, (V,), jnp.float32))(keys)


def _mix32(x: jax.Array) -> jax.Array:
    """Wellons' lowbias32 integer mixer (a bijection of uint32)."""
    x = x ^ (x >> 16)
    x = x * _U32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * _U32(0x846CA68B)
    return x ^ (x >> 16)


def row_words(seeds: jax.Array, index: jax.Array) -> jax.Array:
    """[S, 2] uint32 hash key words of each row: 2 threefry words of its key."""
    return jax.vmap(lambda s, i: jax.random.bits(row_key(s, i), (2,), _U32))(seeds, index)


def bits_to_uniform(h: jax.Array) -> jax.Array:
    """uint32 -> float32 ``((h >> 9) + 0.5) / 2**23``: 2^23 values in [2^-24, 1 - 2^-24], all
    exact in float32 (24 bits would round the top one to 1.0, whose Gumbel is +inf)."""
    return ((h >> 9).astype(jnp.float32) + 0.5) * jnp.float32(2.0 ** -23)


def hash_uniform(words: jax.Array, V: int) -> jax.Array:
    """[S, V] float32 uniforms in (0, 1): :func:`bits_to_uniform` of
    ``h = mix(mix(id * golden + w0) ^ w1)`` for token id and the row's words (w0, w1).

    Args:
      words: [S, 2] uint32 (:func:`row_words`).  V: vocabulary size.
    """
    ids = jnp.arange(V, dtype=_U32)[None, :]
    h = _mix32(ids * _U32(_GOLDEN) + words[:, :1])
    return bits_to_uniform(_mix32(h ^ words[:, 1:2]))


def hash_gumbel(seeds: jax.Array, index: jax.Array, V: int) -> jax.Array:
    """[S, V] float32 standard Gumbel noise ``-log(-log(u))`` of :func:`hash_uniform` (finite:
    about [-2.8, 16.6]; the clipped tails have probability ~6e-8 per element).

    Args:
      seeds: [S, 2] uint32 per-request seed words.  index: [S] int32 sample index.
      V: vocabulary size.
    """
    return -jnp.log(-jnp.log(hash_uniform(row_words(seeds, index), V)))
