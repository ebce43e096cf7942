"""Repetition, frequency and presence penalties of the on-device sampler
(:mod:`jaxinfer.sampling`), and the per-slot token counts they read.

Penalty state lives on the device: ``counts`` [N + 1, V] int32, one row per persistent slot
(the engine gives every running sequence a slot; row N is a scratch row for padding and rows
that do not sample). Bits 0-29 count the token in the output so far; bit 30 flags it as
present in the prompt. The step adds each sampled token to its row; the engine (re)loads a
row from the host with :func:`load_token_history` when a sequence with penalties is admitted
(its prompt may come from the prefix cache and was never fed through a step).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

PROMPT_FLAG = 1 << 30  # bit of a counts entry: the token occurs in the prompt
COUNT_MASK = PROMPT_FLAG - 1  # bits holding the number of occurrences in the output


def apply_penalties(logits: jax.Array, counts_rows: jax.Array, repetition: jax.Array,
                    presence: jax.Array, frequency: jax.Array) -> jax.Array:
    """Repetition, frequency and presence penalties (vLLM ``apply_penalties``).

    Args:
      logits: [S, V] float32.  counts_rows: [S, V] int32 packed counts (module docstring).
      repetition / presence / frequency: [S] float32 (1, 0, 0 leave a row unchanged, bit for
        bit; a repetition penalty <= 0, which SamplingParams never gives, counts as 1).
    Returns:
      [S, V] float32 penalized logits.
    """
    out_counts = (counts_rows & COUNT_MASK).astype(jnp.float32)
    seen = counts_rows != 0  # in the prompt or in the output
    rp = jnp.where(repetition > 0, repetition, 1.0)[:, None]  # 0 (all-zero inputs) = off
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rp, logits * rp), logits)
    return (logits - frequency[:, None] * out_counts
            - presence[:, None] * (out_counts > 0).astype(jnp.float32))


def load_token_history(counts: jax.Array, slot: jax.Array, token_ids: jax.Array,
                       num_prompt: jax.Array) -> jax.Array:
    """Overwrite row ``slot`` of ``counts`` with the counts of one sequence's tokens.

    Args:
      counts: [N + 1, V] int32 packed counts.  slot: int32 scalar row.
      token_ids: [L] int32 the sequence's tokens, prompt first; -1 pads.
      num_prompt: int32 scalar, how many leading tokens are the prompt.
    Returns:
      the updated counts (prompt tokens flagged, output tokens counted).
    """
    V = counts.shape[1]
    pos = jnp.arange(token_ids.shape[0])
    valid = (token_ids >= 0) & (token_ids < V)
    prompt = pos < num_prompt
    row = jnp.zeros((V,), jnp.int32).at[jnp.where(valid & ~prompt, token_ids, V)].add(
        1, mode="drop")
    flag = jnp.zeros((V,), jnp.int32).at[jnp.where(valid & prompt, token_ids, V)].max(
        PROMPT_FLAG, mode="drop")
    return jax.lax.dynamic_update_slice(counts, (row | flag)[None, :], (slot, 0))
