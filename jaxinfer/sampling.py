"""On-device sampling from per-row parameter arrays (inside the compiled step).

Parameters are arrays (:class:`~jaxinfer.batch.SamplingArrays`), not trace-time constants,
so rows with different parameters share one compiled program. The pipeline per row follows
vLLM v1's ``Sampler``:

1. raw logprobs (when any row asks): log-softmax of the raw logits, the chosen token's value
   and the ``MAX_LOGPROBS`` best (vLLM v1's default ``logprobs_mode="raw_logprobs"``);
2. penalties from the row's token counts: repetition (HF / vLLM: over prompt and output
   tokens, positive logits divided, others multiplied), then frequency and presence
   (OpenAI: over output tokens, ``logit -= frequency * count + presence * (count > 0)``);
3. greedy rows take the argmax; the others divide by the temperature, drop tokens whose
   probability is below ``min_p`` times the best one's, keep the ``top_k`` best and the
   ``top_p`` nucleus of what is left (ties at a cut-off are kept, as in vLLM's threshold
   masking) and draw with the Gumbel-max trick.

Each row draws from its own key, ``fold_in(key(seed), sample_index)``, so a request's tokens
depend only on its seed and the index of the token being sampled -- not on the batch it lands
in, its row or its bucket (vLLM's per-request generators, made functional).

Penalty state lives on the device: ``counts`` [N + 1, V] int32, one row per persistent slot
(the engine gives every running sequence a slot; row N is a scratch row for padding and rows
that do not sample). Bits 0-29 count the token in the output so far; bit 30 flags it as
present in the prompt. The step adds each sampled token to its row; the engine (re)loads a
row from the host with :func:`load_token_history` when a sequence with penalties is admitted
(its prompt may come from the prefix cache and was never fed through a step).
Batch-wide conds skip what no row needs: all-greedy rows skip temperature, min-p, top-k/top-p
and the random draw; no top-k/top-p skips the vocabulary sort; no penalties skip the gather of
count rows; no logprobs skip the log-softmax; a top-k of at most ``TOPK_FAST`` in every
filtering row replaces the sort by ``lax.top_k``.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxinfer.batch import SamplingArrays
from jaxinfer.sampling_params import MAX_LOGPROBS

NEG_INF = -jnp.inf
TOPK_FAST = 64  # top-k up to this many tokens skips the vocabulary sort (lax.top_k instead)
PROMPT_FLAG = 1 << 30  # bit of a counts entry: the token occurs in the prompt
COUNT_MASK = PROMPT_FLAG - 1  # bits holding the number of occurrences in the output


class SampleOutput(NamedTuple):
    """What the compiled sample step returns per row.

    Attributes:
      tokens: [S] int32 sampled token ids.
      logprobs: [S] float32 raw log-probability of each sampled token (all 0 when no row of
        the batch asked for logprobs).
      top_ids: [S, K] int32 the K = min(MAX_LOGPROBS, V) most likely token ids, best first.
      top_logprobs: [S, K] float32 their raw log-probabilities.
    """

    tokens: jax.Array
    logprobs: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array


def _row_key(seed: jax.Array, index: jax.Array) -> jax.Array:
    """seed [2] uint32, index int32 -> a typed PRNG key."""
    key = jax.random.key(seed[0])
    key = jax.random.fold_in(key, seed[1])
    return jax.random.fold_in(key, index)


def apply_penalties(logits: jax.Array, counts_rows: jax.Array, repetition: jax.Array,
                    presence: jax.Array, frequency: jax.Array) -> jax.Array:
    """Repetition, frequency and presence penalties (vLLM ``apply_penalties``).

    Args:
      logits: [S, V] float32.  counts_rows: [S, V] int32 packed counts (module docstring).
      repetition / presence / frequency: [S] float32 (1, 0, 0 leave a row unchanged; a
        repetition penalty <= 0, which SamplingParams never gives, counts as 1).
    Returns:
      [S, V] float32 penalized logits.
    """
    out_counts = (counts_rows & COUNT_MASK).astype(jnp.float32)
    seen = counts_rows != 0  # in the prompt or in the output
    rp = jnp.where(repetition > 0, repetition, 1.0)[:, None]  # 0 (all-zero inputs) = off
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rp, logits * rp), logits)
    return (logits - frequency[:, None] * out_counts
            - presence[:, None] * (out_counts > 0).astype(jnp.float32))


def _cutoff(srt: jax.Array, V: int, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """[S] value of the smallest logit that top-k and then top-p keep.

    ``srt`` [S, W] holds each row's W largest scaled logits in descending order (W = V after
    a full sort; W < V when every row's k is at most W).
    """
    W = srt.shape[-1]
    k = jnp.minimum(jnp.where((top_k > 0) & (top_k < V), top_k, V), W)
    in_k = jnp.arange(W)[None, :] < k[:, None]
    probs = jax.nn.softmax(jnp.where(in_k, srt, NEG_INF), axis=-1)
    cum_before = jnp.cumsum(probs, axis=-1) - probs
    # A token survives top-p while the mass before it is below p (the best one always);
    # p = 1 keeps all of top-k whatever the rounding of the cumulative sum.
    keep = in_k & ((cum_before < top_p[:, None]) | (top_p[:, None] >= 1.0))
    n_keep = jnp.maximum(jnp.sum(keep, axis=-1), 1)
    return jnp.take_along_axis(srt, (n_keep - 1)[:, None], axis=-1)[:, 0]


def _draw(logits: jax.Array, sp: SamplingArrays) -> jax.Array:
    """[S, V] processed logits -> [S] int32 tokens (greedy rows: argmax)."""
    V = logits.shape[-1]
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    scaled = logits / jnp.maximum(sp.temperature, 1e-6)[:, None]
    # min-p: p_i >= min_p * p_max  <=>  scaled_i - max >= log(min_p)  (log 0 = -inf keeps all)
    top = jnp.max(scaled, axis=-1, keepdims=True)
    scaled = jnp.where(scaled - top >= jnp.log(sp.min_p)[:, None], scaled, NEG_INF)
    # Rows that sample and filter by rank or mass need a cut-off. When each such row keeps
    # at most TOPK_FAST tokens by top-k, lax.top_k's TOPK_FAST best replace the full sort
    # (top-p acts on the top-k set, so those values are all it needs).
    cuts = (sp.temperature > 0.0) & (((sp.top_k > 0) & (sp.top_k < V)) | (sp.top_p < 1.0))
    narrow = (sp.top_k > 0) & (sp.top_k <= TOPK_FAST)
    none = jnp.full(scaled.shape[:1], NEG_INF, scaled.dtype)

    W = min(TOPK_FAST, V)

    def by_sort() -> jax.Array:
        srt = -jnp.sort(-scaled, axis=-1)
        # Narrow rows take the width-W computation of by_top_k: the same floats either way,
        # so a row's draw does not depend on which path its neighbours force.
        return jnp.where(narrow, _cutoff(srt[:, :W], V, sp.top_k, sp.top_p),
                         _cutoff(srt, V, sp.top_k, sp.top_p))

    def by_top_k() -> jax.Array:
        best = jax.lax.top_k(scaled, W)[0]
        return jnp.where(cuts, _cutoff(best, V, sp.top_k, sp.top_p), NEG_INF)

    cut = jax.lax.cond(
        jnp.any(cuts),
        lambda: jax.lax.cond(jnp.all(narrow | ~cuts), by_top_k, by_sort),
        lambda: none)
    masked = jnp.where(scaled >= cut[:, None], scaled, NEG_INF)
    keys = jax.vmap(_row_key)(sp.seeds, sp.sample_index)
    gumbel = jax.vmap(lambda k: jax.random.gumbel(k, (V,), jnp.float32))(keys)
    sampled = jnp.argmax(masked + gumbel, axis=-1).astype(jnp.int32)
    return jnp.where(sp.temperature == 0.0, greedy, sampled)


def _logprobs(logits: jax.Array, tokens: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    K = min(MAX_LOGPROBS, logits.shape[-1])
    lse = jax.nn.logsumexp(logits, axis=-1)
    chosen = jnp.take_along_axis(logits, tokens[:, None], axis=-1)[:, 0] - lse
    top_v, top_i = jax.lax.top_k(logits, K)
    return chosen, top_i.astype(jnp.int32), top_v - lse[:, None]


def sample_rows(logits: jax.Array, sp: SamplingArrays, counts: jax.Array
                ) -> tuple[SampleOutput, jax.Array]:
    """Sample one token per row and record it in the row's slot of ``counts``.

    Args:
      logits: [S, V] raw logits (any float dtype; computed in float32).
      sp: per-row parameters, each [S] ([S, 2] uint32 seeds); see ``batch.SamplingArrays``.
      counts: [N + 1, V] int32 packed token counts (module docstring); row N is scratch.
    Returns:
      (SampleOutput, updated counts). Rows whose slot is < 0 or >= N use the scratch row.
    """
    logits = logits.astype(jnp.float32)
    S, V = logits.shape
    N = counts.shape[0] - 1
    slots = jnp.where((sp.slots >= 0) & (sp.slots < N), sp.slots, N)
    rp = sp.repetition_penalty
    penalized = jnp.any(((rp != 1.0) & (rp > 0.0)) | (sp.presence_penalty != 0.0)
                        | (sp.frequency_penalty != 0.0))
    proc = jax.lax.cond(
        penalized,
        lambda: apply_penalties(logits, counts[slots], sp.repetition_penalty,
                                sp.presence_penalty, sp.frequency_penalty),
        lambda: logits)
    tokens = jax.lax.cond(jnp.all(sp.temperature == 0.0),
                          lambda: jnp.argmax(proc, axis=-1).astype(jnp.int32),
                          lambda: _draw(proc, sp))
    K = min(MAX_LOGPROBS, V)
    chosen, top_i, top_v = jax.lax.cond(
        jnp.any(sp.want_logprobs), lambda: _logprobs(logits, tokens),
        lambda: (jnp.zeros((S,), jnp.float32), jnp.zeros((S, K), jnp.int32),
                 jnp.zeros((S, K), jnp.float32)))
    counts = counts.at[slots, tokens].add((slots < N).astype(jnp.int32))
    return SampleOutput(tokens, chosen, top_i, top_v), counts


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


def sample(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
           seeds: jax.Array, sample_index: jax.Array) -> jax.Array:
    """Sample one token per row with temperature / top-k / top-p only (no penalties, no
    min-p, no logprobs): :func:`sample_rows` with neutral values for the rest.

    Args:
      logits: [S, V] float32.  temperature: [S] float32, 0 = greedy.
      top_k: [S] int32, 0 = off.  top_p: [S] float32 in (0, 1].
      seeds: [S, 2] uint32 per-request seed words.  sample_index: [S] int32.
    Returns:
      [S] int32 token ids.
    """
    S, V = logits.shape
    f32 = jnp.float32
    sp = SamplingArrays(temperature=temperature, top_k=top_k, top_p=top_p,
                        min_p=jnp.zeros((S,), f32), repetition_penalty=jnp.ones((S,), f32),
                        presence_penalty=jnp.zeros((S,), f32),
                        frequency_penalty=jnp.zeros((S,), f32), seeds=seeds,
                        sample_index=sample_index, slots=jnp.full((S,), -1, jnp.int32),
                        want_logprobs=jnp.zeros((S,), bool))
    out, _ = sample_rows(logits, sp, jnp.zeros((1, V), jnp.int32))
    return out.tokens
