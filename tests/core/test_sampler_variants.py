"""The sampler variants the runner compiles (``sampling.SAMPLER_VARIANTS``) over random
parameter arrays: the variant a batch gets only turns flags on (never off for a part some row
needs, against a per-row reference written here) and is the cheapest that covers the batch;
each variant gives the rows it serves the results of the batch's exact flags and of the
all-True program; the host flags
(``SamplerNeeds.of``) are the definition the device-side conds use."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.batch import SamplingArrays
from jaxinfer.sampling import (
    SAMPLER_VARIANTS,
    SamplerNeeds,
    _needs,
    sample_rows,
    sampler_bucket,
    sampler_variant,
)
from jaxinfer.sampling_bad_words import MAX_BAD_WORD_SEQS, MAX_BAD_WORD_TOKENS
from jaxinfer.sampling_filters import BUFFER_TOP_K
from jaxinfer.sampling_params import MAX_LOGIT_BIAS
from jaxinfer.sampling_penalties import LogitBias

V = 96
FLAGS = SamplerNeeds._fields


def _random_params(rng, S: int) -> SamplingArrays:
    """Mostly neutral batches: each field is set on some rows with a per-batch probability,
    so that batches needing few parts (cheap variants) are as common as mixed ones."""
    sa = SamplingArrays.neutral(S)
    sa.seeds[:] = rng.integers(0, 2**32, (S, 2), dtype=np.uint64).astype(np.uint32)
    sa.sample_index[:] = rng.integers(-5, 50, S)  # < 0: a prompt chunk that does not sample
    sa.slots[:] = rng.permutation(S)
    values = {"temperature": [0.5, 1.0, 1.5, 1e-30], "top_k": [1, 3, 20, V - 1, V, V + 7],
              "top_p": [0.3, 0.9, 0.999], "min_p": [0.05, 0.5],
              "repetition_penalty": [1.3, 0.8, 0.0], "presence_penalty": [0.5, -0.5],
              "frequency_penalty": [0.4, -1.0], "want_logprobs": [True],
              "min_tokens": [5, 30, 60],  # stop tokens masked while sample_index < min_tokens
              "allowed_only": [True],  # allowed_token_ids: other tokens masked
              "has_bias": [True]}  # logit_bias: the slot's table added
    for name, choices in values.items():
        if rng.random() < 0.5:
            rows = rng.random(S) < rng.uniform(0.1, 0.9)
            getattr(sa, name)[rows] = rng.choice(choices, int(rows.sum()))
    return sa


def _row_needs(sa: SamplingArrays, i: int) -> set[str]:
    """What row ``i`` needs, from the definitions (``sampling.sample_rows``'s docstrings)."""
    need = set()
    rp = float(sa.repetition_penalty[i])
    if (rp > 0 and rp != 1.0) or sa.presence_penalty[i] != 0 or sa.frequency_penalty[i] != 0:
        need.add("penalties")
    if 0 < sa.min_tokens[i] and sa.sample_index[i] < sa.min_tokens[i]:
        need.add("penalties")  # the min_tokens mask of stop tokens runs in that stage
    if sa.allowed_only[i]:
        need.add("penalties")  # so does the allowed_token_ids mask
    if sa.has_bias[i]:
        need |= {"penalties", "bias"}  # the logit_bias: in that stage, its own flag
    if sa.temperature[i] > 0:
        need.add("sampling")
        if 0 < sa.top_k[i] < V:
            need.add("top_k_search")
        if sa.top_p[i] < 1:
            need.add("top_p_search")
        if ("top_k_search" in need or "top_p_search" in need) and not (
                0 < sa.top_k[i] <= min(V - 1, BUFFER_TOP_K)):
            need.add("full_search")  # no small top-k: cut-offs searched over the vocabulary
    if sa.want_logprobs[i]:
        need.add("logprobs")
    return need


def _covers(needs: SamplerNeeds, parts: set[str]) -> bool:
    return all(getattr(needs, p) for p in parts)


def test_variant_turns_flags_on_only_and_is_the_cheapest_cover():
    rng = np.random.default_rng(0)
    seen: dict[str, int] = {}
    for trial in range(3000):
        S = int(rng.choice([1, 2, 5, 8, 32]))
        sa = _random_params(rng, S)
        parts = set().union(*(_row_needs(sa, i) for i in range(S)))
        exact = SamplerNeeds.of(sa, V)
        assert {f for f in FLAGS if getattr(exact, f)} == parts, trial
        assert exact == SamplerNeeds(**{k: bool(v) for k, v in _needs(np, sa, V).items()})
        name = sampler_variant(sa, V)
        assert _covers(SAMPLER_VARIANTS[name], parts), (trial, name, parts)
        # No variant listed before it covers the batch (the list is cheapest first).
        earlier = list(SAMPLER_VARIANTS)[:list(SAMPLER_VARIANTS).index(name)]
        assert not any(_covers(SAMPLER_VARIANTS[e], parts) for e in earlier), (trial, name)
        seen[name] = seen.get(name, 0) + 1
    assert set(seen) == set(SAMPLER_VARIANTS), seen  # the random batches reach every variant
    assert SAMPLER_VARIANTS[list(SAMPLER_VARIANTS)[-1]] == SamplerNeeds()  # the fallback


def test_variants_give_the_rows_they_serve_the_results_of_exact_and_all_flags():
    rng = np.random.default_rng(1)
    S = 6
    run = jax.jit(sample_rows, static_argnums=3)
    # Every slot's logit_bias table: 12 ids with biases that move the argmax.
    ids = np.full((S + 1, MAX_LOGIT_BIAS), -1, np.int32)
    ids[:, :12] = [rng.permutation(V)[:12] for _ in range(S + 1)]
    # ... and bad words: sequences of 1-3 tokens among the likely ones, whose prefixes the
    # slots' last outputs (``recent``) match often.
    bad = np.full((S + 1, MAX_BAD_WORD_SEQS, MAX_BAD_WORD_TOKENS), -1, np.int32)
    for s_ in range(S + 1):
        for j in range(10):
            n = 1 + j % 3
            bad[s_, j, -n:] = rng.integers(20, 30, n)
    bias = LogitBias.zeros(S + 1)._replace(
        ids=jnp.asarray(ids),
        values=jnp.asarray(rng.uniform(-6, 6, (S + 1, MAX_LOGIT_BIAS)), jnp.float32),
        bad_ids=jnp.asarray(bad),
        recent=jnp.asarray(rng.integers(20, 30, (S + 1, MAX_BAD_WORD_TOKENS - 1)), jnp.int32))
    batches: dict[str, list[SamplingArrays]] = {name: [] for name in SAMPLER_VARIANTS}
    for _ in range(2000):
        sa = _random_params(rng, S)
        batches[sampler_variant(sa, V)].append(sa)
    assert all(len(b) >= 8 for b in batches.values()), {k: len(b) for k, b in batches.items()}
    for name, sas in batches.items():
        for sa in sas[:8]:
            logits = np.round(rng.standard_normal((S, V)) * 3, 1).astype(np.float32)  # ties
            counts = np.zeros((S + 1, V), np.int32)
            counts[:S, :30] = rng.integers(0, 3, (S, 30))
            counts[:S, 30:40] |= 1 << 30  # in the prompt
            counts[:S, 36:44] |= 1 << 29  # stop tokens (masked before min_tokens)
            counts[:S, 20:70] |= 1 << 28  # allowed tokens (the rest masked on allowed_only)
            args = (jnp.asarray(logits), SamplingArrays(*map(jnp.asarray, sa)),
                    jnp.asarray(counts))
            got, got_counts, got_bias = run(*args, SAMPLER_VARIANTS[name], bias)
            asked = np.asarray(sa.want_logprobs)
            # The same as the flags the batch needs exactly, and as all flags on.
            for needs in (SamplerNeeds.of(sa, V), SamplerNeeds()):
                want, want_counts, want_bias = run(*args, needs, bias)
                np.testing.assert_array_equal(got.tokens, want.tokens, err_msg=name)
                np.testing.assert_array_equal(got_counts, want_counts, err_msg=name)
                np.testing.assert_array_equal(got_bias.recent, want_bias.recent, err_msg=name)
                for a, b in zip(got[1:], want[1:]):  # logprobs, top ids, top logprobs
                    np.testing.assert_array_equal(np.asarray(a)[asked], np.asarray(b)[asked])


def test_sampler_bucket_names_a_variant():
    b = sampler_bucket(8, "top_p")
    assert (b.kind, b.num_tokens, b.num_seqs, b.max_pages) == ("top_p", 8, 8, 0)
    with pytest.raises(KeyError, match="unknown sampler variant"):
        sampler_bucket(8, "nucleus")
