"""``bad_words`` of the on-device sampler (vLLM's ``SamplingParams.bad_words``).

A request's bad words are strings; the engine encodes each one twice, as vLLM does
(``vllm/logits_process.py`` ``_get_bad_words_ids``): as given (leading spaces stripped) and
with one leading space, the second kept only when it starts with another token and has as
many tokens (a word at the start of the text and in the middle of it). Each encoding is a
token sequence w[0..L-1]; at every sampled token the sampler bans (logit -inf) w[L-1] when the
row's last L-1 *output* tokens equal w[0..L-2] -- a one-token word is always banned
(vLLM v1 ``apply_bad_words``: prompt tokens do not count, and a word longer than the outputs
so far + 1 cannot match). Where the bans leave no token at all (only possible with
``allowed_token_ids``, or the stop tokens masked before ``min_tokens``; the engine refuses
one-token words that always do), the row takes the banned token with the largest logit:
the other constraints win (:func:`fallback_tokens`; vLLM leaves the case undefined).

The sequences live on the device beside the ``logit_bias`` tables
(``sampling_penalties.LogitBias``): ``bad_ids`` [N + 1, MAX_BAD_WORD_SEQS,
MAX_BAD_WORD_TOKENS] int32, each sequence right-aligned with -1 on its left (an unused entry
is all -1), and ``recent`` [N + 1, MAX_BAD_WORD_TOKENS - 1] int32, the slot's last output
tokens (oldest first, -1 where it has fewer), which the sampler shifts at every token it
samples for a row with a table (:func:`push_recent`) -- so multi-token words are matched
inside multi-step windows too, where the host sees the tokens only afterwards. The engine
loads both when it admits the sequence (``recent`` from the outputs it has, after a
preemption).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

# Most token sequences of a request's bad words after the leading-space forms (vLLM's GPU
# runner: MAX_NUM_BAD_WORDS = 128), and most tokens of one (vLLM allows 1,024 in all).
MAX_BAD_WORD_SEQS = 128
MAX_BAD_WORD_TOKENS = 16


class BadWordsError(ValueError):
    """A request's ``bad_words`` cannot be encoded into the device table; says which word."""


def bad_words_token_ids(words: Sequence[str], encode: Any) -> list[list[int]]:
    """The token sequences the sampler bans for ``words`` (vLLM ``_get_bad_words_ids``).

    Args:
      words: the request's ``bad_words`` (non-empty strings; SamplingParams checks).
      encode: ``text -> list[int]`` without special tokens (``Tokenizer.encode(text,
        add_special_tokens=False)``).
    Returns:
      the distinct sequences, in the order vLLM builds them (word by word: as given with
      leading spaces stripped, then with one leading space where that is a different
      first token and the same length).
    Raises:
      BadWordsError: a word encodes to no token or to more than MAX_BAD_WORD_TOKENS, or
        the sequences exceed MAX_BAD_WORD_SEQS.
    """
    seqs: list[list[int]] = []
    for i, word in enumerate(words):
        plain = list(encode(word.lstrip()))
        if not plain:
            raise BadWordsError(f"bad_words[{i}] {word!r} encodes to no token")
        spaced = list(encode(" " + word.lstrip()))
        forms = [plain] + ([spaced] if spaced and spaced[0] != plain[0]
                           and len(spaced) == len(plain) else [])
        for ids in forms:
            if len(ids) > MAX_BAD_WORD_TOKENS:
                raise BadWordsError(f"bad_words[{i}] {word!r} is {len(ids)} tokens; at most "
                                    f"{MAX_BAD_WORD_TOKENS}")
            if ids not in seqs:
                seqs.append(ids)
    if len(seqs) > MAX_BAD_WORD_SEQS:
        raise BadWordsError(f"bad_words encode to {len(seqs)} token sequences (with and "
                            f"without a leading space); at most {MAX_BAD_WORD_SEQS}")
    return seqs


def encode_bad_words(tokenizer: Any, words: Sequence[str], vocab_size: int
                     ) -> list[list[int]]:
    """:func:`bad_words_token_ids` with ``tokenizer`` (a ``jaxinfer.tokenizer.Tokenizer``),
    checked against the model's vocabulary. Raises BadWordsError without a tokenizer, for a
    word that encodes to nothing or too many tokens, or ids outside [0, ``vocab_size``)."""
    if tokenizer is None:
        raise BadWordsError("bad_words need a tokenizer; this model has none (use "
                            "logit_bias to ban token ids)")
    seqs = bad_words_token_ids(words, lambda t: tokenizer.encode(t, add_special_tokens=False))
    if outside := sorted({t for s in seqs for t in s if not 0 <= t < vocab_size}):
        raise BadWordsError(f"bad_words encode to ids {outside[:8]} outside the model's "
                            f"vocabulary [0, {vocab_size})")
    return seqs


def table_rows(seqs: Sequence[Sequence[int]], outputs: Sequence[int]
               ) -> tuple[np.ndarray, np.ndarray]:
    """One slot's (bad_ids [MAX_BAD_WORD_SEQS, MAX_BAD_WORD_TOKENS], recent
    [MAX_BAD_WORD_TOKENS - 1]) int32 rows: ``seqs`` right-aligned, -1 padded; ``recent`` the
    last output tokens of ``outputs``. Raises ValueError beyond the table's size."""
    if len(seqs) > MAX_BAD_WORD_SEQS or any(len(s) > MAX_BAD_WORD_TOKENS for s in seqs):
        raise ValueError(f"bad words table holds {MAX_BAD_WORD_SEQS} sequences of at most "
                         f"{MAX_BAD_WORD_TOKENS} tokens")
    ids = np.full((MAX_BAD_WORD_SEQS, MAX_BAD_WORD_TOKENS), -1, np.int32)
    for j, s in enumerate(seqs):
        if s:
            ids[j, MAX_BAD_WORD_TOKENS - len(s):] = s
    recent = np.full((MAX_BAD_WORD_TOKENS - 1,), -1, np.int32)
    tail = list(outputs)[-(MAX_BAD_WORD_TOKENS - 1):]
    if tail:
        recent[len(recent) - len(tail):] = tail
    return ids, recent


def bad_word_bans(bad_ids: jax.Array, recent: jax.Array, on: jax.Array,
                  vocab_size: int) -> jax.Array:
    """[S, W] int32: the tokens each row bans now (vLLM v1 ``apply_bad_words``): w[-1] for
    each sequence w whose prefix w[:-1] equals the row's last len(w) - 1 outputs;
    ``vocab_size`` where none (rows not ``on``, unused entries, non-matching ones).

    Args:
      bad_ids: [S, W, L] int32 the rows' sequences (right-aligned, -1 pads on the left).
      recent: [S, L - 1] int32 the rows' last output tokens (oldest first, -1 where fewer).
      on: [S] bool rows whose table applies.
    """
    prefix, last = bad_ids[:, :, :-1], bad_ids[:, :, -1]
    match = jnp.all((prefix < 0) | (prefix == recent[:, None, :]), axis=-1)
    ban = on[:, None] & match & (last >= 0) & (last < vocab_size)
    return jnp.where(ban, last, vocab_size)


def mask_bad_words(logits: jax.Array, bans: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(logits with each row's ``bans`` [S, W] set to -inf, [S, W] float32 the banned
    entries' values before: -inf for ``vocab_size`` pads), for :func:`fallback_tokens`.
    The values are gathered before the scatter, so the logits are updated in place."""
    S, V = logits.shape
    before = jnp.take_along_axis(logits, jnp.minimum(bans, V - 1), axis=1)
    before = jnp.where(bans < V, before, -jnp.inf)
    return logits.at[jnp.arange(S)[:, None], bans].set(-jnp.inf, mode="drop"), before


def fallback_tokens(tokens: jax.Array, processed: jax.Array, bans: jax.Array,
                    before: jax.Array) -> jax.Array:
    """``tokens`` [S], except rows whose bans left nothing to sample (the chosen token's
    processed logit is -inf, so every one was: possible only where ``allowed_token_ids``,
    or the stop tokens masked before ``min_tokens``, left few tokens): those take the banned
    token whose logit was largest before the bans -- the other constraints win over the
    bad words, and the row never gets a token they exclude (argmax of an all -inf row
    would be token 0). vLLM leaves this case undefined."""
    chosen = jnp.take_along_axis(processed, tokens[:, None], axis=1)[:, 0]
    best = jnp.argmax(before, axis=1)
    alt = jnp.take_along_axis(bans, best[:, None], axis=1)[:, 0]
    dead = (chosen == -jnp.inf) & (jnp.max(before, axis=1) > -jnp.inf)
    return jnp.where(dead, alt, tokens)


def push_recent(recent: jax.Array, slots: jax.Array, tokens: jax.Array,
                on: jax.Array) -> jax.Array:
    """``recent`` [N + 1, L - 1] int32 with each row's sampled token appended to its slot's
    row (the oldest dropped), for rows ``on`` [S] bool; ``slots`` [S] int32 already clipped
    to [0, N] (row N is scratch), ``tokens`` [S] int32."""
    rows = jnp.concatenate([recent[slots][:, 1:], tokens[:, None]], axis=1)
    N = recent.shape[0] - 1
    return recent.at[jnp.where(on, slots, N + 1)].set(rows, mode="drop")
