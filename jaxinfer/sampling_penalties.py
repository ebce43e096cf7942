"""Repetition, frequency and presence penalties of the on-device sampler
(:mod:`jaxinfer.sampling`), and the per-slot token counts they read.

Penalty state lives on the device: ``counts`` [N + 1, V] int32, one row per persistent slot
(the engine gives every running sequence a slot; row N is a scratch row for padding and rows
that do not sample). Bits 0-27 count the token in the output so far; bit 28 flags it as one
of the request's ``allowed_token_ids`` or of the tokens its structured-outputs grammar allows
next (:func:`load_allowed_masks`, each step between the model and sampler programs; a row
that has them masks every other token); bit 29 flags it as one of the sequence's stop
tokens (EOS unless ``ignore_eos``, ``stop_token_ids``), masked while the row has fewer than
``min_tokens`` outputs; bit 30 flags it as present in the prompt. The step adds each sampled
token to its row; the engine (re)loads a row from the host with :func:`load_token_history`
when a sequence with penalties, ``min_tokens`` or ``allowed_token_ids`` is admitted (its
prompt may come from the prefix cache and was never fed through a step).

The ``min_tokens`` mask follows vLLM v1's ``MinTokensLogitsProcessor``
(vllm/v1/sample/logits_processor): the logits of a row's stop tokens are -inf while its
sample index is below ``min_tokens``; the ``allowed_token_ids`` mask follows its allowed-ids
processing (every other token -inf). Raw logprobs are computed before both, as there.

``logit_bias`` (OpenAI's, vLLM v1's ``LogitBiasLogitsProcessor``) lives beside the counts in
:class:`LogitBias`, a sparse per-slot table: [N + 1, MAX_LOGIT_BIAS] token ids (-1 pads) and
float32 biases, loaded by :func:`load_logit_bias` when a sequence with a bias is admitted and
added to the row's logits (:func:`add_logit_bias`) before the penalties, as vLLM v1 adds it
before ``apply_penalties``. The same tables hold the slot's ``bad_words`` sequences and its
last output tokens (:mod:`jaxinfer.sampling_bad_words`), loaded by the same call.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxinfer.sampling_bad_words import MAX_BAD_WORD_SEQS, MAX_BAD_WORD_TOKENS
from jaxinfer.sampling_params import MAX_LOGIT_BIAS

PROMPT_FLAG = 1 << 30  # bit of a counts entry: the token occurs in the prompt
STOP_FLAG = 1 << 29  # bit of a counts entry: a stop token of the sequence (min_tokens mask)
ALLOWED_FLAG = 1 << 28  # bit of a counts entry: one of the request's allowed_token_ids
COUNT_MASK = ALLOWED_FLAG - 1  # bits holding the number of occurrences in the output
STOP_IDS_PER_CALL = 128  # ids one load_token_history call flags ([128] int32, -1 pads)


class LogitBias(NamedTuple):
    """Per-slot ``logit_bias`` and ``bad_words`` tables on the device.

    Attributes:
      ids: [N + 1, MAX_LOGIT_BIAS] int32 token ids of slot n's biases; -1 pads.
      values: [N + 1, MAX_LOGIT_BIAS] float32 the biases, added to those tokens' logits.
      bad_ids: [N + 1, MAX_BAD_WORD_SEQS, MAX_BAD_WORD_TOKENS] int32 slot n's bad-word token
        sequences, right-aligned, -1 pads (:mod:`jaxinfer.sampling_bad_words`).
      recent: [N + 1, MAX_BAD_WORD_TOKENS - 1] int32 slot n's last output tokens, oldest
        first, -1 where it has fewer; the sampler appends each token it samples for a row
        with a table (the only field it writes).
    Row N is the scratch row of padding rows (never loaded; rows that use it have no bias).
    """

    ids: Any
    values: Any
    bad_ids: Any
    recent: Any

    @classmethod
    def zeros(cls, num_rows: int, abstract: bool = False) -> LogitBias:
        """Empty tables of ``num_rows`` slots (``jax.ShapeDtypeStruct`` with ``abstract``)."""
        i32, f32 = jnp.int32, jnp.float32
        shapes = ((num_rows, MAX_LOGIT_BIAS, i32), (num_rows, MAX_LOGIT_BIAS, f32),
                  (num_rows, MAX_BAD_WORD_SEQS, MAX_BAD_WORD_TOKENS, i32),
                  (num_rows, MAX_BAD_WORD_TOKENS - 1, i32))
        if abstract:
            return cls(*(jax.ShapeDtypeStruct(s[:-1], s[-1]) for s in shapes))
        return cls(*(jnp.full(s[:-1], 0 if s[-1] == f32 else -1, s[-1]) for s in shapes))


def masks_stops(sample_index, min_tokens):
    """[S] bool (numpy or jax, from [S] int32 arrays): the row's stop tokens are masked, as it
    samples output ``sample_index`` < its ``min_tokens`` (0 = off; a prompt chunk that does
    not sample has a negative index and no mask)."""
    return (min_tokens > 0) & (sample_index < min_tokens)


def apply_penalties(logits: jax.Array, counts_rows: jax.Array, repetition: jax.Array,
                    presence: jax.Array, frequency: jax.Array,
                    mask_stops: jax.Array | None = None,
                    allowed_only: jax.Array | None = None) -> jax.Array:
    """Repetition, frequency and presence penalties (vLLM ``apply_penalties``), and the
    ``min_tokens`` mask of stop tokens (vLLM v1 ``MinTokensLogitsProcessor``).

    Args:
      logits: [S, V] float32.  counts_rows: [S, V] int32 packed counts (module docstring).
      repetition / presence / frequency: [S] float32 (1, 0, 0 leave a row unchanged, bit for
        bit; a repetition penalty <= 0, which SamplingParams never gives, counts as 1).
      mask_stops: [S] bool, the row has fewer outputs than its ``min_tokens``: the logits of
        its flagged stop tokens become -inf (False or None leaves the row unchanged).
      allowed_only: [S] bool, the row has ``allowed_token_ids``: the logits of every token
        not flagged as allowed become -inf (False or None leaves the row unchanged).
    Returns:
      [S, V] float32 penalized logits.
    """
    out_counts = (counts_rows & COUNT_MASK).astype(jnp.float32)
    seen = (counts_rows & (PROMPT_FLAG | COUNT_MASK)) != 0  # in the prompt or in the output
    rp = jnp.where(repetition > 0, repetition, 1.0)[:, None]  # 0 (all-zero inputs) = off
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rp, logits * rp), logits)
    if mask_stops is not None:
        stop = (counts_rows & STOP_FLAG) != 0
        logits = jnp.where(stop & mask_stops[:, None], -jnp.inf, logits)
    if allowed_only is not None:
        other = (counts_rows & ALLOWED_FLAG) == 0
        logits = jnp.where(other & allowed_only[:, None], -jnp.inf, logits)
    return (logits - frequency[:, None] * out_counts
            - presence[:, None] * (out_counts > 0).astype(jnp.float32))


def load_token_history(counts: jax.Array, slot: jax.Array, token_ids: jax.Array,
                       num_prompt: jax.Array, stop_ids: jax.Array | None = None,
                       keep: jax.Array | None = None,
                       flag: jax.Array | None = None) -> jax.Array:
    """Overwrite row ``slot`` of ``counts`` with the counts of one sequence's tokens and the
    flags of its stop tokens (or, with ``keep``, add more flags to the row).

    Args:
      counts: [N + 1, V] int32 packed counts.  slot: int32 scalar row.
      token_ids: [L] int32 the sequence's tokens, prompt first; -1 pads.
      num_prompt: int32 scalar, how many leading tokens are the prompt.
      stop_ids: [STOP_IDS_PER_CALL] int32 token ids to flag as stop tokens (the ``min_tokens``
        mask); -1 pads; None flags none. Ids outside [0, V) are ignored.
      keep: bool scalar; True ORs this call's flags and counts into the row instead of
        overwriting it (more ids than one call takes, or allowed ids after the stop ids:
        the engine calls again with ``token_ids`` all -1).
      flag: int32 scalar, the bit ``stop_ids`` get: STOP_FLAG (None) or ALLOWED_FLAG.
    Returns:
      the updated counts (prompt tokens flagged, output tokens counted, stop tokens flagged).
    """
    V = counts.shape[1]
    pos = jnp.arange(token_ids.shape[0])
    valid = (token_ids >= 0) & (token_ids < V)
    prompt = pos < num_prompt
    row = jnp.zeros((V,), jnp.int32).at[jnp.where(valid & ~prompt, token_ids, V)].add(
        1, mode="drop")
    in_prompt = jnp.zeros((V,), jnp.int32).at[jnp.where(valid & prompt, token_ids, V)].max(
        PROMPT_FLAG, mode="drop")
    new = row | in_prompt
    if stop_ids is not None:
        ok = (stop_ids >= 0) & (stop_ids < V)
        bit = jnp.int32(STOP_FLAG) if flag is None else flag
        new = new | jnp.zeros((V,), jnp.int32).at[jnp.where(ok, stop_ids, V)].max(
            bit, mode="drop")
    if keep is not None:
        old = jax.lax.dynamic_slice(counts, (slot, 0), (1, V))[0]
        new = jnp.where(keep, old | new, new)
    return jax.lax.dynamic_update_slice(counts, new[None, :], (slot, 0))


def load_allowed_masks(counts: jax.Array, slots: jax.Array, masks: jax.Array) -> jax.Array:
    """Set the ``ALLOWED_FLAG`` bits of rows ``slots`` of ``counts`` from token bitmasks (a
    structured-outputs grammar's next allowed tokens, ``jaxinfer.structured_outputs``),
    keeping the rows' other bits.

    Args:
      counts: [N + 1, V] int32 packed counts.
      slots: [R] int32 rows; padding rows name the scratch row N.
      masks: [R, W] int32, W = ceil(V / 32): token t is allowed when bit t % 32 of word
        t // 32 is set (llguidance's layout).
    Returns:
      the updated counts.
    """
    R, W = masks.shape
    V = counts.shape[1]
    bits = (masks[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # [R, W, 32], no gather
    allowed = bits.reshape(R, W * 32)[:, :V] != 0  # [R, V]
    rows = counts[slots]
    rows = (rows & ~ALLOWED_FLAG) | jnp.where(allowed, ALLOWED_FLAG, 0).astype(jnp.int32)
    return counts.at[slots].set(rows)


def add_logit_bias(penalized: jax.Array, logits: jax.Array, counts: jax.Array,
                   bias: LogitBias, slots: jax.Array, has_bias: jax.Array,
                   **penalties: jax.Array | None) -> jax.Array:
    """Rows' ``logit_bias`` added to their logits before the penalties (vLLM v1
    ``LogitBiasLogitsProcessor``, then ``apply_penalties``), given the penalized logits.

    The biased entries are recomputed on the gathered [S, MAX_LOGIT_BIAS] subset -- raw
    logit + bias, then :func:`apply_penalties` with the same per-row arguments on their
    counts entries (it is elementwise per token) -- and written over ``penalized``: no
    second pass over [S, V], and no copy of the raw logits (which a scatter into them would
    need, as the raw logprobs still read them; 95 us a call at S = 256, V = 128256 on an
    H100).

    Args:
      penalized: [S, V] float32, ``apply_penalties(logits, counts[slots], **penalties)``.
      logits: [S, V] float32 raw logits.  counts: [N + 1, V] int32 packed counts.
      bias: the per-slot tables ([N + 1, MAX_LOGIT_BIAS]).
      slots: [S] int32 rows of ``counts`` and ``bias`` (already clipped to [0, N]).
      has_bias: [S] bool, the row's request has a ``logit_bias`` (its slot's table is
        loaded); other rows are left as ``penalized`` bit for bit.
      penalties: the keyword arguments ``penalized`` was computed with (repetition,
        presence, frequency, mask_stops, allowed_only).
    Returns:
      [S, V] float32 logits; table ids outside [0, V) are ignored.
    """
    S, V = logits.shape
    ids, values = bias.ids[slots], bias.values[slots]  # [S, MAX_LOGIT_BIAS]
    ok = has_bias[:, None] & (ids >= 0) & (ids < V)
    safe = jnp.where(ok, ids, 0)
    sub = jnp.take_along_axis(logits, safe, axis=1) + values
    sub = apply_penalties(sub, counts[slots[:, None], safe], **penalties)
    return penalized.at[jnp.arange(S)[:, None], jnp.where(ok, ids, V)].set(sub, mode="drop")


def load_logit_bias(bias: LogitBias, slot: jax.Array, ids: jax.Array, values: jax.Array,
                    bad_ids: jax.Array, recent: jax.Array) -> LogitBias:
    """Overwrite slot ``slot``'s tables with one request's ``logit_bias`` and bad words.

    Args:
      bias: the per-slot tables.  slot: int32 scalar row.
      ids: [MAX_LOGIT_BIAS] int32 token ids, -1 pads (distinct, in the vocabulary: the
        engine checks).  values: [MAX_LOGIT_BIAS] float32 their biases.
      bad_ids: [MAX_BAD_WORD_SEQS, MAX_BAD_WORD_TOKENS] int32 bad-word sequences, and
      recent: [MAX_BAD_WORD_TOKENS - 1] int32 the last outputs so far
        (``sampling_bad_words.table_rows``).
    Returns:
      the updated tables.
    """
    def put(table: jax.Array, row: jax.Array) -> jax.Array:
        return jax.lax.dynamic_update_slice(table, row[None], (slot,) + (0,) * row.ndim)

    return LogitBias(put(bias.ids, ids), put(bias.values, values), put(bias.bad_ids, bad_ids),
                     put(bias.recent, recent))
