"""On-device sampling from per-row parameter arrays (inside the compiled step).

Parameters are arrays, not trace-time constants, so rows with different temperature /
top-k / top-p share one compiled program. Each row draws from its own key,
``fold_in(key(seed), sample_index)``, so a request's tokens depend only on its seed and the
index of the token being sampled — not on the batch it lands in (the approach of vLLM's
per-request generators, made functional).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

NEG_INF = -jnp.inf


def _row_key(seed: jax.Array, index: jax.Array) -> jax.Array:
    """seed [2] uint32, index int32 -> a typed PRNG key."""
    key = jax.random.key(seed[0])
    key = jax.random.fold_in(key, seed[1])
    return jax.random.fold_in(key, index)


def _sample_row(logits: jax.Array, temperature: jax.Array, top_k: jax.Array,
                top_p: jax.Array, seed: jax.Array, index: jax.Array) -> jax.Array:
    """One row: logits [V] float32 -> token id (int32)."""
    V = logits.shape[-1]
    greedy = jnp.argmax(logits).astype(jnp.int32)
    scaled = logits / jnp.maximum(temperature, 1e-6)
    # Sort once, descending; top-k masks ranks >= k, top-p masks tokens whose preceding
    # cumulative probability already reaches p (the top token always survives).
    order = jnp.argsort(-scaled)
    sorted_logits = scaled[order]
    rank = jnp.arange(V)
    k = jnp.where(top_k > 0, top_k, V)
    keep = rank < k
    probs = jax.nn.softmax(jnp.where(keep, sorted_logits, NEG_INF))
    cum_before = jnp.cumsum(probs) - probs
    keep &= cum_before < top_p
    masked = jnp.where(keep, sorted_logits, NEG_INF)
    choice = jax.random.categorical(_row_key(seed, index), masked)
    sampled = order[choice].astype(jnp.int32)
    return jnp.where(temperature == 0.0, greedy, sampled)


def sample(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
           seeds: jax.Array, sample_index: jax.Array) -> jax.Array:
    """Sample one token per row.

    Args:
      logits: [S, V] float32.
      temperature: [S] float32, 0 = greedy (argmax).
      top_k: [S] int32, 0 = off.  top_p: [S] float32 in (0, 1].
      seeds: [S, 2] uint32 per-request seed words.  sample_index: [S] int32.
    Returns:
      [S] int32 token ids.
    """
    def full(_):
        return jax.vmap(_sample_row)(logits, temperature, top_k, top_p, seeds, sample_index)

    def all_greedy(_):
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)

    # An all-greedy batch (the common offline case) skips the vocabulary sort.
    return jax.lax.cond(jnp.all(temperature == 0.0), all_greedy, full, None)
