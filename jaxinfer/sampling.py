"""On-device sampling from per-row parameter arrays (a small compiled program per step).

Parameters are arrays (:class:`~jaxinfer.batch.SamplingArrays`), not trace-time constants,
so rows with different parameters share one compiled program. The pipeline per row follows
vLLM v1's ``Sampler``:

1. raw logprobs (when any row asks): log-softmax of the raw logits, the chosen token's value
   and the ``MAX_LOGPROBS`` best (vLLM v1's default ``logprobs_mode="raw_logprobs"``);
2. penalties from the row's token counts: repetition (HF / vLLM: over prompt and output
   tokens, positive logits divided, others multiplied), then frequency and presence
   (OpenAI: over output tokens, ``logit -= frequency * count + presence * (count > 0)``);
   in the same stage, the row's stop tokens (EOS, ``stop_token_ids``) get -inf while it has
   fewer than ``min_tokens`` outputs (vLLM v1's ``MinTokensLogitsProcessor``), and every
   token outside its ``allowed_token_ids`` (when it has them) gets -inf; a row's
   ``logit_bias`` is added to its logits first (as vLLM v1 adds it before the penalties),
   and its ``bad_words`` tokens get -inf last (:mod:`jaxinfer.sampling_bad_words`);
3. greedy rows take the argmax; the others divide by the temperature, drop tokens whose
   probability is below ``min_p`` times the best one's, keep the ``top_k`` best and the
   ``top_p`` nucleus of what is left (ties at a cut-off are kept, as in vLLM's threshold
   masking) and draw with the Gumbel-max trick.

No vocabulary sort (:mod:`jaxinfer.sampling_filters`): every filtering row finds its k-th
value and its nucleus by an exact threshold search (fused multi-pivot reductions; measured on
the H200, XLA's TopK kernel costs more per call at vocab 128k than a pass of the search),
over the row's 64 best chunks of 64 logits (at V = 128256) when its top-k is at most 64, else
over the vocabulary; the 20 best logprobs come from the 20 best chunks by two ``lax.top_k`` of
at most 16 (no sort on XLA:GPU; :mod:`jaxinfer.sampling_topk`). Each row takes its path from
its own parameters whatever the program, so a row's floats do not depend on its neighbours.

Each row draws from its own key, ``fold_in(key(seed), sample_index)``, so a request's tokens
depend only on its seed and the index of the token being sampled -- not on the batch it lands
in, its row or its bucket (vLLM's per-request generators, made functional).

Penalty state lives on the device, in ``counts`` (one packed row of token counts per
persistent slot, :mod:`jaxinfer.sampling_penalties`): the step adds each sampled token to
its row.

Work no row of the batch needs is skipped by static flags (:class:`SamplerNeeds`: penalties,
temperature and draw, top-k search, top-p search, logprobs, full-vocabulary search), so the
compiled sampler has no conditional. The runner (``runner.py``) runs the sampler as its own
small program after the model program, the logits staying on the device: it reads the batch's
needs on the host from the numpy parameters (``SamplerNeeds.of``, as vLLM decides
``all_greedy``, ``no_penalties`` and ``max_num_logprobs`` on the host) and rounds them up to
one of the few compiled variants of :data:`SAMPLER_VARIANTS` (:func:`sampler_variant`). A
flag that is on where no row needs it changes no row's token, nor the logprobs of a row that
asked (neutral parameters leave a row bit for bit as it was), so any covering variant, and
``SamplerNeeds()`` (all on), gives the same results.

``needs=None`` decides on the device instead, by batch-wide ``lax.cond``s; kept as the
baseline of ``benchmarks/sampling_cost.py``, the runner never uses it. On XLA:GPU every
``lax.cond`` copies its predicate to the host and blocks until the stream reaches it (xla
``backends/gpu/runtime/conditional_thunk.cc``: ``Memcpy`` then ``BlockHostUntilDone``;
command buffers, which could keep it on the device, leave ``CONDITIONAL`` out of
``--xla_gpu_enable_command_buffer``'s default set), so the call does not return before the
device has run everything queued ahead of the cond, and each cond splits the command buffers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import sampling_filters, sampling_noise
from jaxinfer.batch import Bucket, SamplingArrays
from jaxinfer.row_reduce import row_argmax, row_max
from jaxinfer.sampling_bad_words import (
    MAX_BAD_WORD_SEQS,
    bad_word_bans,
    fallback_tokens,
    mask_bad_words,
    push_recent,
)
from jaxinfer.sampling_filters import buffered_cutoffs, kth_largest, nucleus_cut
from jaxinfer.sampling_params import MAX_LOGPROBS
from jaxinfer.sampling_penalties import LogitBias, add_logit_bias, apply_penalties, masks_stops
from jaxinfer.sampling_topk import top_values

__all__ = ["SAMPLER_VARIANTS", "SampleOutput", "SamplerNeeds", "sample", "sample_rows",
           "sampler_bucket", "sampler_variant"]

NEG_INF = -jnp.inf
# Gumbel noise of the draw (jaxinfer/sampling_noise.py): "threefry" (jax.random.gumbel per
# element) or "hash" (threefry per row, a counter hash per element, fused into one argmax
# with the greedy rows). Read at trace time; benchmarks/sampling_cost.py --draw-method times both.
# H200 (session 7): top_p B=256 960 -> 895 us, temperature B=256 298 -> 211 us (with "sort"
# selection and the nucleus floor). A seed's token stream differs between the two methods.
DRAW_METHOD = "hash"
DRAW_METHODS = ("threefry", "hash")
# Row max / argmax of the draw over [S, V] in two stages of about this many chunks a row
# (jaxinfer.row_reduce; exact, same results); 0: XLA's one-stage reductions. H200 (session 7,
# 128 chunks): 2-10 % slower in every sampler mix (XLA's own row reductions already stream).
REDUCE_CHUNKS = 0


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


def _needs(xp: Any, sp: SamplingArrays, V: int) -> dict[str, Any]:
    """Which parts of the sampler some row of the batch needs (numpy or jax ``xp``)."""
    rows = _row_filters(sp, V)
    rp = sp.repetition_penalty
    return {
        "penalties": xp.any(((rp != 1.0) & (rp > 0.0)) | (sp.presence_penalty != 0.0)
                            | (sp.frequency_penalty != 0.0)
                            | masks_stops(sp.sample_index, sp.min_tokens) | sp.allowed_only
                            | sp.has_bias),
        "sampling": xp.any(sp.temperature > 0.0),
        "top_k_search": xp.any(rows["sampling"] & rows["k_on"]),
        "top_p_search": xp.any(rows["sampling"] & rows["p_on"]),
        "logprobs": xp.any(sp.want_logprobs),
        "full_search": xp.any(rows["cuts"] & ~rows["k_small"]),
        "bias": xp.any(sp.has_bias),
    }


def _row_filters(sp: SamplingArrays, V: int) -> dict[str, Any]:
    """Per-row [S] bool: samples, top-k on, top-p on, filtered (samples with either), small
    top-k (on and <= ``sampling_filters.BUFFER_TOP_K``: cut-offs searched in a buffer)."""
    sampling = sp.temperature > 0.0
    k_on = (sp.top_k > 0) & (sp.top_k < V)
    p_on = sp.top_p < 1.0
    return {"sampling": sampling, "k_on": k_on, "p_on": p_on,
            "cuts": sampling & (k_on | p_on),
            "k_small": k_on & (sp.top_k <= sampling_filters.BUFFER_TOP_K)}


class SamplerNeeds(NamedTuple):
    """Static flags: the parts of :func:`sample_rows` some row of the batch needs.

    Each False flag drops a part from the compiled program; it must be True whenever a row
    of the batch needs the part (``of`` computes exactly that). All True (the default) is one
    program that serves any batch.

    Attributes:
      penalties: some row has a repetition, presence or frequency penalty, or masks its stop
        tokens (``sampling_penalties.masks_stops``: sample_index < min_tokens, min_tokens > 0),
        or has ``allowed_token_ids`` or a ``logit_bias``.
      sampling: some row has temperature > 0.
      top_k_search: some sampling row has 0 < top_k < V.
      top_p_search: some sampling row has top_p < 1.
      logprobs: some row asked for logprobs.
      full_search: some sampling row with top-k or top-p has no top-k of at most
        ``sampling_filters.BUFFER_TOP_K`` (its cut-offs are searched over the whole vocabulary;
        rows with such a top-k search a gathered buffer whatever the flags).
      bias: some row has a ``logit_bias`` or ``bad_words`` (``sp.has_bias``; in the
        penalties stage, so it needs ``penalties`` too). Its own flag because writing the
        biased entries over the penalized logits materializes them instead of fusing them
        into the draw: +58 us a call at S = 256, V = 128256 on an H100 (session 37), which
        batches without a bias should not pay.
    """

    penalties: bool = True
    sampling: bool = True
    top_k_search: bool = True
    top_p_search: bool = True
    logprobs: bool = True
    full_search: bool = True
    bias: bool = True

    @classmethod
    def of(cls, sp: SamplingArrays, vocab_size: int) -> SamplerNeeds:
        """The flags of a batch from its host (numpy) parameter arrays, each [S].

        Runs on the host every sample step, on the arrays the step was built with: at most
        a dozen numpy calls on [S] arrays, no per-row Python (5-11 us at S = 16-256 on the
        2-core CPU). Equal to ``_needs(np, ...)``, the definition the device-side conds
        use (tested).
        """
        a, nz = np.asarray, np.count_nonzero  # count_nonzero: cheaper than .any() here
        rp = a(sp.repetition_penalty)
        penalties = bool(nz((rp != 1.0) & (rp > 0.0)) or nz(a(sp.presence_penalty))
                         or nz(a(sp.frequency_penalty))
                         or nz(masks_stops(a(sp.sample_index), a(sp.min_tokens)))
                         or nz(a(sp.allowed_only)) or nz(a(sp.has_bias)))
        rows = a(sp.temperature) > 0.0
        sampling = bool(nz(rows))
        top_k = top_p = full = False
        if sampling:
            k = a(sp.top_k)
            k_on = rows & (k > 0) & (k < vocab_size)
            p_on = rows & (a(sp.top_p) < 1.0)
            top_k, top_p = bool(nz(k_on)), bool(nz(p_on))
            full = bool(nz((k_on | p_on) & ~(k_on & (k <= sampling_filters.BUFFER_TOP_K))))
        return cls(penalties, sampling, top_k, top_p, bool(nz(a(sp.want_logprobs))), full,
                   bool(nz(a(sp.has_bias))))


# The sampler programs the runner compiles for each row count S, cheapest first. A step runs
# the first variant whose flags cover its batch's SamplerNeeds (flags are only ever turned
# on, which changes no row's result). Why these, from the H200 costs per call at vocab 128k
# (benchmarks/RESULTS.md, "Sampling cost"; B=1 / B=256): greedy 7.5 / 38 us; temperature
# 15 / 240 us; top-p search 114 / 1,370 us; top-k + top-p 203 / 2,424 us; logprobs 334 /
# 849 us; penalties only add ~2 / ~30 us to a program. So the chain follows the common
# requests: greedy, temperature (the OpenAI default), + top-p, + top-k; penalties are cheap,
# so the sampling variants carry them (a batch with a repetition penalty does not fall back to
# the all-True program, 3.3 ms at B=256; a greedy one takes "temperature", its draw wasted);
# logprobs are not cheap, and take the all-True program, the universal fallback that serves
# any batch. Each variant is one more program per S (top-k alone takes "top_k_top_p").
# "top_k_top_p" serves batches whose filtering rows all have a small top-k (searched in a
# gathered buffer, no full-vocabulary pass but one); "top_k_top_p_full" any top-k / top-p mix;
# "top_k_top_p_logprobs" the same as "top_k_top_p" with logprobs (top-20 from 20 chunks since
# the chunked top_values), so that such a batch does not pay the vocabulary search of "full";
# "logprobs" the same without the top-k / top-p searches (a greedy or temperature-only batch
# that asked for logprobs paid the buffered search in "top_k_top_p_logprobs": 1,140 us at
# B=256 on the H200, session 5). A logit_bias takes "temperature_bias" (greedy or temperature
# rows) or "top_k_top_p_full_bias" (any top-k / top-p), or "full" with logprobs.
_F, _T = False, True
SAMPLER_VARIANTS: dict[str, SamplerNeeds] = {
    "greedy": SamplerNeeds(_F, _F, _F, _F, _F, _F, _F),
    "temperature": SamplerNeeds(_T, _T, _F, _F, _F, _F, _F),
    "top_k_top_p": SamplerNeeds(_T, _T, _T, _T, _F, _F, _F),
    "top_p": SamplerNeeds(_T, _T, _F, _T, _F, _T, _F),
    "top_k_top_p_full": SamplerNeeds(_T, _T, _T, _T, _F, _T, _F),
    "logprobs": SamplerNeeds(_T, _T, _F, _F, _T, _F, _F),
    "top_k_top_p_logprobs": SamplerNeeds(_T, _T, _T, _T, _T, _F, _F),
    "temperature_bias": SamplerNeeds(_T, _T, _F, _F, _F, _F, _T),
    "top_k_top_p_full_bias": SamplerNeeds(_T, _T, _T, _T, _F, _T, _T),
    "full": SamplerNeeds(),
}
_NFLAGS = len(SamplerNeeds._fields)
# Every flag combination -> the first variant covering it (128 entries).
_COVER = {SamplerNeeds(*(bool(i >> b & 1) for b in range(_NFLAGS))): next(
    name for name, v in SAMPLER_VARIANTS.items()
    if all(have or not (i >> b & 1) for b, have in enumerate(v)))
    for i in range(1 << _NFLAGS)}


def sampler_variant(sp: SamplingArrays, vocab_size: int) -> str:
    """Name in :data:`SAMPLER_VARIANTS` of the cheapest program that serves a batch: its
    ``SamplerNeeds.of`` rounded up (a flag a row needs is never off)."""
    return _COVER[SamplerNeeds.of(sp, vocab_size)]


def sampler_bucket(num_seqs: int, variant: str) -> Bucket:
    """Bucket of the sampler program of ``variant`` for ``num_seqs`` rows:
    Bucket(variant, S, S, 0), run in mode ``runner.SAMPLER``. Raises KeyError for an unknown
    variant."""
    if variant not in SAMPLER_VARIANTS:
        raise KeyError(f"unknown sampler variant {variant!r}; one of {list(SAMPLER_VARIANTS)}")
    return Bucket(variant, num_seqs, num_seqs, 0)


_When = Callable[[str, Callable[[], Any], Callable[[], Any]], Any]


def _cutoff(scaled: jax.Array, top: jax.Array, sp: SamplingArrays, when: _When) -> jax.Array:
    """[S] value of the smallest scaled logit that top-k and then top-p keep (-inf: no cut).

    Rows with a small top-k (``k_small``) always take the buffered search
    (``sampling_filters.buffered_cutoffs``), the others the full-vocabulary one, whatever the
    flags: a row's floats do not depend on the program that serves it.
    """
    S, V = scaled.shape
    rows = _row_filters(sp, V)
    none = jnp.full((S,), NEG_INF, jnp.float32)
    k = jnp.where(rows["k_on"], sp.top_k, V)
    # Rows without top-k take -inf as their k-th value on both branches (same floats after);
    # without a nucleus search every row's top_p is 1, whose cut is the k-th value. A row
    # whose result is dropped searches with k = 0 / top_p = 1, which the Pallas search
    # (sampling_filters.SEARCH_IMPL) answers without a pass.
    k_full = rows["k_on"] & ~rows["k_small"]
    kth = when("top_k_search", lambda: when(
        "full_search", lambda: jnp.where(k_full, kth_largest(
            scaled, top, jnp.where(k_full, k, 0)), NEG_INF), lambda: none), lambda: none)
    p_full = jnp.where(rows["cuts"] & ~rows["k_small"], sp.top_p, 1.0)
    cut = when("full_search", lambda: when(
        "top_p_search", lambda: nucleus_cut(scaled, top, kth, k, p_full), lambda: kth),
        lambda: none)

    def small() -> jax.Array:  # rows with 0 < top_k <= BUFFER_TOP_K
        k_b = jnp.where(rows["k_small"], k, 1)
        p_b = jnp.where(rows["k_small"], sp.top_p, 1.0)
        _, c = when("top_p_search",
                    lambda: buffered_cutoffs(scaled, top, k_b, p_b),
                    lambda: buffered_cutoffs(scaled, top, k_b, None))
        return jnp.where(rows["k_small"], c, cut)

    cut = when("top_k_search", small, lambda: cut) if sampling_filters.BUFFER_TOP_K else cut
    return jnp.where(rows["cuts"], cut, NEG_INF)


def _draw(logits: jax.Array, sp: SamplingArrays, when: _When) -> jax.Array:
    """[S, V] processed logits -> [S] int32 tokens (greedy rows: argmax); Gumbel noise as
    ``DRAW_METHOD`` says (:mod:`jaxinfer.sampling_noise`)."""
    V = logits.shape[-1]
    greedy = None if DRAW_METHOD == "hash" else row_argmax(logits, REDUCE_CHUNKS)
    scaled = logits / jnp.maximum(sp.temperature, 1e-6)[:, None]
    # min-p: p_i >= min_p * p_max  <=>  scaled_i - max >= log(min_p)  (log 0 = -inf keeps all)
    top = row_max(scaled, REDUCE_CHUNKS)
    scaled = jnp.where(scaled - top[:, None] >= jnp.log(sp.min_p)[:, None], scaled, NEG_INF)
    cut = _cutoff(scaled, top, sp, when)
    masked = jnp.where(scaled >= cut[:, None], scaled, NEG_INF)
    if DRAW_METHOD not in DRAW_METHODS:
        raise ValueError(f"DRAW_METHOD {DRAW_METHOD!r}: one of {DRAW_METHODS}")
    if DRAW_METHOD == "hash":  # one argmax, greedy rows selecting their logits
        noisy = masked + sampling_noise.hash_gumbel(sp.seeds, sp.sample_index, V)
        return row_argmax(jnp.where((sp.temperature == 0.0)[:, None], logits, noisy),
                          REDUCE_CHUNKS)
    gumbel = sampling_noise.threefry_gumbel(sp.seeds, sp.sample_index, V)
    sampled = row_argmax(masked + gumbel, REDUCE_CHUNKS)
    return jnp.where(sp.temperature == 0.0, greedy, sampled)


def _logprobs(logits: jax.Array, tokens: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    top_v, top_i = top_values(logits, min(MAX_LOGPROBS, logits.shape[-1]))
    m = top_v[:, 0]  # the row maximum; log-sum-exp as jax.nn.logsumexp computes it
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    lse = jnp.log(jnp.sum(jnp.exp(logits - m[:, None]), axis=-1)) + m
    chosen = jnp.take_along_axis(logits, tokens[:, None], axis=-1)[:, 0] - lse
    return chosen, top_i, top_v - lse[:, None]


def sample_rows(logits: jax.Array, sp: SamplingArrays, counts: jax.Array,
                needs: SamplerNeeds | None = None, bias: LogitBias | None = None
                ) -> tuple[SampleOutput, jax.Array]:
    """Sample one token per row and record it in the row's slot of ``counts``.

    Args:
      logits: [S, V] raw logits (any float dtype; computed in float32).
      sp: per-row parameters, each [S] ([S, 2] uint32 seeds); see ``batch.SamplingArrays``.
      counts: [N + 1, V] int32 packed token counts (:mod:`jaxinfer.sampling_penalties`);
        row N is scratch.
      needs: static flags covering the parts the batch needs (``SamplerNeeds.of``, or a
        variant of ``SAMPLER_VARIANTS`` covering it: what the runner passes), or None to
        decide on the device with ``lax.cond`` (module docstring: each one is a host sync on
        XLA:GPU). Every covering choice gives every row the same result.
      bias: the per-slot ``logit_bias`` and ``bad_words`` tables (``LogitBias``, rows of
        ``counts``' slots), applied to rows with ``sp.has_bias`` (the bias added, then the
        penalties, then the bad words' tokens -inf); None: no row has either.
    Returns:
      (SampleOutput, updated counts, updated tables: each ``sp.has_bias`` row's token
      appended to its slot's ``recent``; None when ``bias`` is None). Rows whose slot is
      < 0 or >= N use the scratch row.
    """
    logits = logits.astype(jnp.float32)
    S, V = logits.shape
    N = counts.shape[0] - 1
    slots = jnp.where((sp.slots >= 0) & (sp.slots < N), sp.slots, N)
    if needs is None:
        preds = _needs(jnp, sp, V)

        def when(name: str, f: Callable[[], Any], g: Callable[[], Any]) -> Any:
            return jax.lax.cond(preds[name], f, g)
    else:
        def when(name: str, f: Callable[[], Any], g: Callable[[], Any]) -> Any:
            return f() if getattr(needs, name) else g()

    no_bans = (jnp.full((S, MAX_BAD_WORD_SEQS), V, jnp.int32),
               jnp.full((S, MAX_BAD_WORD_SEQS), NEG_INF, jnp.float32))

    def penalized() -> tuple[jax.Array, tuple]:  # the logit bias, then the penalties (vLLM
        # v1's order), then the bad words; with the bans and their values before them
        kw = dict(repetition=sp.repetition_penalty, presence=sp.presence_penalty,
                  frequency=sp.frequency_penalty,
                  mask_stops=masks_stops(sp.sample_index, sp.min_tokens),
                  allowed_only=sp.allowed_only)
        out = apply_penalties(logits, counts[slots], **kw)
        if bias is None:
            return out, no_bans

        def biased() -> tuple[jax.Array, tuple]:
            bans = bad_word_bans(bias.bad_ids[slots], bias.recent[slots], sp.has_bias, V)
            proc, before = mask_bad_words(
                add_logit_bias(out, logits, counts, bias, slots, sp.has_bias, **kw), bans)
            return proc, (bans, before)

        return when("bias", biased, lambda: (out, no_bans))

    proc, (bans, before) = when("penalties", penalized, lambda: (logits, no_bans))
    tokens = when("sampling", lambda: _draw(proc, sp, when),
                  lambda: row_argmax(proc, REDUCE_CHUNKS))
    if bias is not None:  # bad words that left nothing yield to the other constraints
        tokens = when("bias", lambda: fallback_tokens(tokens, proc, bans, before),
                      lambda: tokens)
    K = min(MAX_LOGPROBS, V)
    chosen, top_i, top_v = when(
        "logprobs", lambda: _logprobs(logits, tokens),
        lambda: (jnp.zeros((S,), jnp.float32), jnp.zeros((S, K), jnp.int32),
                 jnp.zeros((S, K), jnp.float32)))
    counts = counts.at[slots, tokens].add((slots < N).astype(jnp.int32))
    if bias is not None:  # the bad words' view of the outputs (rows with a table)
        bias = when("bias", lambda: bias._replace(recent=push_recent(
            bias.recent, slots, tokens, sp.has_bias & (slots < N))), lambda: bias)
    return SampleOutput(tokens, chosen, top_i, top_v), counts, bias


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
                        want_logprobs=jnp.zeros((S,), bool), min_tokens=jnp.zeros((S,), jnp.int32),
                        allowed_only=jnp.zeros((S,), bool), has_bias=jnp.zeros((S,), bool))
    out, _, _ = sample_rows(logits, sp, jnp.zeros((1, V), jnp.int32))
    return out.tokens
