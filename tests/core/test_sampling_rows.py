"""Full on-device sampler (sampling.sample_rows): min-p / top-k / top-p exclusion, penalties
and logprobs against numpy references, slot state, seeds independent of the batch."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.batch import SamplingArrays
from jaxinfer.sampling import sample_rows
from jaxinfer.sampling_bad_words import table_rows
from jaxinfer.sampling_params import MAX_LOGIT_BIAS
from jaxinfer.sampling_penalties import (
    ALLOWED_FLAG,
    COUNT_MASK,
    PROMPT_FLAG,
    STOP_FLAG,
    STOP_IDS_PER_CALL,
    LogitBias,
    load_logit_bias,
    load_token_history,
)

V = 64
N_SLOTS = 6
_run = jax.jit(sample_rows)


def _params(S: int, **kw) -> SamplingArrays:
    sa = SamplingArrays.neutral(S)
    sa.seeds[:] = np.stack([np.arange(S) + 11, np.full(S, 3)], 1)
    for name, v in kw.items():
        getattr(sa, name)[...] = v
    return sa


def _sample(logits, sa: SamplingArrays, counts=None):
    counts = np.zeros((N_SLOTS + 1, logits.shape[1]), np.int32) if counts is None else counts
    out, new_counts, _ = _run(jnp.asarray(logits, jnp.float32),
                           SamplingArrays(*map(jnp.asarray, sa)), jnp.asarray(counts))
    return jax.tree.map(np.asarray, out), np.asarray(new_counts)


def _softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _allowed(logits, temperature, top_k, top_p, min_p):
    """vLLM v1 order in numpy: temperature, min-p, top-k, top-p (ties at cut-offs kept)."""
    x = logits / temperature
    p = _softmax(x)
    keep = p >= min_p * p.max()
    x = np.where(keep, x, -np.inf)
    srt = np.sort(x)[::-1]
    k = top_k if 0 < top_k < len(x) else len(x)
    keep &= x >= srt[k - 1]
    q = _softmax(np.where(keep, x, -np.inf))
    order = np.argsort(-q, kind="stable")
    before = np.cumsum(q[order]) - q[order]
    n = max(1, int(np.sum(before < top_p))) if top_p < 1 else len(x)
    thresh = q[order][min(n, int(keep.sum())) - 1]
    return set(np.flatnonzero(keep & (q >= thresh)).tolist())


@pytest.mark.parametrize("temperature, top_k, top_p, min_p", [
    (1.0, 0, 1.0, 0.2), (1.5, 5, 1.0, 0.05), (0.7, 0, 0.6, 0.0), (1.0, 10, 0.8, 0.1),
    (2.0, 3, 0.5, 0.3),
])
def test_filters_never_emit_an_excluded_token(temperature, top_k, top_p, min_p):
    rng = np.random.default_rng(int(temperature * 100 + top_k))
    S = 8
    logits = rng.standard_normal((S, V)) * 2
    allowed = [_allowed(logits[i], temperature, top_k, top_p, min_p) for i in range(S)]
    seen = [set() for _ in range(S)]
    for step in range(40):
        sa = _params(S, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                     sample_index=step)
        toks = _sample(logits, sa)[0].tokens
        for i in range(S):
            assert toks[i] in allowed[i], (i, toks[i], sorted(allowed[i]))
            seen[i].add(int(toks[i]))
    # It samples: rows with several allowed tokens show more than one of them.
    wide = [s for s, a in zip(seen, allowed) if len(a) > 1]
    assert wide and any(len(s) > 1 for s in wide)


def test_min_p_renormalizes_the_distribution():
    logits = np.log(np.array([[0.4, 0.3, 0.2, 0.1] + [1e-6] * (V - 4)]))
    counts = np.zeros(V)
    for step in range(500):
        counts[_sample(logits, _params(1, temperature=1.0, min_p=0.4,
                                       sample_index=step))[0].tokens[0]] += 1
    # min_p 0.4 of p_max 0.4 = 0.16: keeps 0.4, 0.3, 0.2 renormalized to 4/9, 3/9, 2/9.
    assert counts[3:].sum() == 0
    np.testing.assert_allclose(counts[:3] / 500, [4 / 9, 3 / 9, 2 / 9], atol=0.07)


def test_temperature_to_zero_is_greedy_also_with_filters():
    rng = np.random.default_rng(5)
    logits = rng.standard_normal((16, V)) * 3
    for t in (0.0, 1e-4):
        sa = _params(16, temperature=t, top_k=7, top_p=0.9, min_p=0.05)
        np.testing.assert_array_equal(_sample(logits, sa)[0].tokens, logits.argmax(-1))


def _np_penalties(logits, prompt_tokens, output_tokens, rep, pres, freq):
    out = logits.copy()
    counts = np.bincount(output_tokens, minlength=len(logits)).astype(np.float64)
    seen = (counts > 0) | np.isin(np.arange(len(logits)), prompt_tokens)
    out[seen] = np.where(out[seen] > 0, out[seen] / rep, out[seen] * rep)
    return out - freq * counts - pres * (counts > 0)


def test_penalties_match_numpy_and_counts_follow_the_samples():
    rng = np.random.default_rng(7)
    S = 5
    logits = rng.standard_normal((S, V)) * 2
    prompts = [rng.integers(0, V, rng.integers(1, 12)) for _ in range(S)]
    outputs = [rng.integers(0, V, rng.integers(0, 20)) for _ in range(S)]
    counts = jnp.zeros((N_SLOTS + 1, V), jnp.int32)
    load = jax.jit(load_token_history)
    slots = np.array([4, 0, 2, 5, 1])
    L = 40
    for i in range(S):
        toks = np.full(L, -1, np.int32)
        ids = np.concatenate([prompts[i], outputs[i]])
        toks[:len(ids)] = ids
        counts = load(counts, jnp.int32(slots[i]), jnp.asarray(toks), jnp.int32(len(prompts[i])))
    c = np.asarray(counts)
    for i in range(S):  # the loaded rows are the numpy counts and prompt flags
        row = c[slots[i]]
        np.testing.assert_array_equal(row & COUNT_MASK,
                                      np.bincount(outputs[i], minlength=V))
        np.testing.assert_array_equal(row >= PROMPT_FLAG, np.isin(np.arange(V), prompts[i]))
    rep = np.array([1.0, 1.5, 0.6, 1.2, 2.0], np.float32)
    pres = np.array([0.0, 0.5, -1.0, 2.0, 0.3], np.float32)
    freq = np.array([0.0, 0.4, 0.7, -0.5, 1.5], np.float32)
    sa = _params(S, repetition_penalty=rep, presence_penalty=pres, frequency_penalty=freq,
                 slots=slots)  # greedy rows: the argmax of the penalized logits
    out, new_counts = _sample(logits, sa, c)
    for i in range(S):
        ref = _np_penalties(logits[i], prompts[i], outputs[i], rep[i], pres[i], freq[i])
        assert out.tokens[i] == np.argmax(ref), i
    # Each sampled token was added to its row; other rows are unchanged.
    expect = c.copy()
    expect[slots, out.tokens] += 1
    np.testing.assert_array_equal(new_counts, expect)


def test_penalties_shift_the_sampled_distribution_exactly():
    # One row sampled many times with a frequency penalty: frequencies follow the softmax of
    # the numpy-penalized logits (the penalty reaches the random draw, not only the argmax).
    logits = np.zeros((1, V))
    logits[0, :3] = [2.0, 2.0, 2.0]
    outputs = np.array([0, 0, 1])
    counts = np.zeros((N_SLOTS + 1, V), np.int32)
    counts[2] = np.bincount(outputs, minlength=V)
    ref = _softmax(_np_penalties(logits[0], [], outputs, 1.0, 0.0, 0.5))
    hits = np.zeros(V)
    for step in range(600):
        sa = _params(1, temperature=1.0, frequency_penalty=0.5, slots=2, sample_index=step)
        hits[_sample(logits, sa, counts)[0].tokens[0]] += 1
    np.testing.assert_allclose(hits[:3] / 600, ref[:3], atol=0.06)


def test_logprobs_match_numpy_log_softmax_of_raw_logits():
    rng = np.random.default_rng(9)
    S = 4
    logits = rng.standard_normal((S, V)) * 4
    sa = _params(S, temperature=[0.0, 1.0, 0.8, 0.0], want_logprobs=[True, False, True, True],
                 repetition_penalty=[1.5, 1.0, 1.0, 1.0], slots=[0, 1, 2, 3])
    counts = np.zeros((N_SLOTS + 1, V), np.int32)
    counts[0, logits[0].argmax()] = PROMPT_FLAG  # penalized, but logprobs stay raw
    out, _ = _sample(logits, sa, counts)
    ref = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    np.testing.assert_allclose(out.logprobs, ref[np.arange(S), out.tokens], atol=1e-5)
    order = np.argsort(-ref, axis=-1)[:, :20]
    np.testing.assert_array_equal(out.top_ids, order)
    np.testing.assert_allclose(out.top_logprobs, np.take_along_axis(ref, order, -1), atol=1e-5)
    # Nobody asks: the log-softmax is skipped and zeros come back.
    quiet, _ = _sample(logits, _params(S))
    assert not quiet.logprobs.any() and not quiet.top_logprobs.any()


def test_seeded_rows_ignore_neighbours_buckets_and_their_parameters():
    rng = np.random.default_rng(11)
    logits = rng.standard_normal((8, V)) * 2
    kw = dict(temperature=0.9, top_k=20, top_p=0.95, min_p=0.02, repetition_penalty=1.3,
              presence_penalty=0.4, frequency_penalty=0.2)
    counts = np.zeros((N_SLOTS + 1, V), np.int32)
    counts[3, :10] = 2
    alone = _params(1, sample_index=17, slots=3, **kw)
    alone.seeds[:] = [123, 456]
    ref = _sample(logits[5:6], alone, counts)[0].tokens[0]
    # The same row at position 5 of 8, neighbours greedy / differently filtered / penalized.
    mixed = _params(8, temperature=[0, 1.2, 0.5, 0, 2.0, 0.9, 1.0, 0], top_k=[0, 3, 0, 0, 9, 20,
                    0, 0], slots=[-1, 0, 1, -1, 2, 3, 4, 5], frequency_penalty=[0, 1, 0, 0, 0,
                    0.2, -1, 0])
    for name, v in kw.items():
        getattr(mixed, name)[5] = v
    mixed.sample_index[5] = 17
    mixed.seeds[5] = [123, 456]
    assert _sample(logits, mixed, counts)[0].tokens[5] == ref
    # Different seeds give different streams.
    draws = set()
    for s in range(8):
        other = _params(1, sample_index=17, slots=3, **kw)
        other.seeds[:] = [1000 + s, 0]
        draws.add(int(_sample(logits[5:6], other, counts)[0].tokens[0]))
    assert len(draws) > 1


def test_all_zero_inputs_are_greedy_rows():
    # Benchmarks replay programs on zero-filled arguments: that must be the plain fast path.
    rng = np.random.default_rng(2)
    logits = rng.standard_normal((4, V))
    zeros = SamplingArrays(*(np.zeros_like(a) for a in SamplingArrays.neutral(4)))
    out, _ = _sample(logits, zeros)
    np.testing.assert_array_equal(out.tokens, logits.argmax(-1))
    assert not out.logprobs.any()


def test_top_k_fast_path_and_sort_path_agree():
    # A row with top_k <= TOPK_FAST is cut from lax.top_k alone, or from the full sort when a
    # neighbour needs it (top_p without top_k): the same tokens either way, all allowed.
    from jaxinfer.sampling_topk import TOPK_FAST

    W = 4 * TOPK_FAST
    rng = np.random.default_rng(13)
    logits = rng.standard_normal((2, W)) * 1.5
    allowed = _allowed(logits[0], 1.1, 12, 0.85, 0.0)
    for step in range(30):
        kw = dict(temperature=1.1, top_k=12, top_p=0.85, sample_index=step)
        alone = _sample(logits[:1], _params(1, **kw))[0].tokens[0]
        pair = _params(2, **kw)
        pair.top_k[1], pair.top_p[1] = 0, 0.9  # forces the sort
        pair.seeds[1] = pair.seeds[0] + 1
        assert _sample(logits, pair)[0].tokens[0] == alone
        assert alone in allowed


def _stop_ids(ids) -> jnp.ndarray:
    out = np.full(STOP_IDS_PER_CALL, -1, np.int32)
    out[:len(ids)] = ids
    return jnp.asarray(out)


def test_load_history_flags_stop_tokens_and_keep_adds_more():
    rng = np.random.default_rng(3)
    load = jax.jit(load_token_history)
    counts = jnp.asarray(rng.integers(0, 1 << 31, (N_SLOTS + 1, V), dtype=np.int64)
                         .astype(np.int32))  # stale rows: every bit set somewhere
    toks = np.full(24, -1, np.int32)
    toks[:9] = [5, 7, 7, 1, 9, 9, 9, 2, 60]  # prompt 5 7 7 1, outputs 9 9 9 2 60
    stops = [2, 9, 63, V + 3, -1]  # out-of-vocabulary and padding ids are ignored
    c = load(counts, jnp.int32(3), jnp.asarray(toks), jnp.int32(4), _stop_ids(stops),
             jnp.bool_(False))
    row = np.asarray(c)[3]
    want = np.zeros(V, np.int64)
    want[[9, 2, 60]] = [3, 1, 1]
    np.testing.assert_array_equal(row & COUNT_MASK, want)
    np.testing.assert_array_equal((row & PROMPT_FLAG) != 0, np.isin(np.arange(V), [5, 7, 1]))
    np.testing.assert_array_equal((row & STOP_FLAG) != 0, np.isin(np.arange(V), [2, 9, 63]))
    others = [i for i in range(N_SLOTS + 1) if i != 3]
    np.testing.assert_array_equal(np.asarray(c)[others], np.asarray(counts)[others])
    # keep: a second call ORs more stop flags in and leaves the counts as they were.
    c2 = np.asarray(load(c, jnp.int32(3), jnp.full(24, -1, jnp.int32), jnp.int32(0),
                         _stop_ids([0, 40]), jnp.bool_(True)))[3]
    np.testing.assert_array_equal(c2 & ~STOP_FLAG, row & ~STOP_FLAG)
    np.testing.assert_array_equal((c2 & STOP_FLAG) != 0,
                                  np.isin(np.arange(V), [0, 2, 9, 40, 63]))


def test_min_tokens_masks_stop_tokens_until_then_and_keeps_raw_logprobs():
    rng = np.random.default_rng(11)
    S = 6
    logits = rng.standard_normal((S, V)).astype(np.float32)
    stops = [3, 17, 40]
    logits[:, stops] += 8.0  # the stop tokens are every row's most likely tokens
    counts = np.zeros((N_SLOTS + 1, V), np.int32)
    counts[:S, stops] = STOP_FLAG
    counts[1, 40] |= 2  # also seen twice in the output: penalties and the mask compose
    sample_index = np.array([0, 2, 4, 5, 0, 7])
    min_tokens = np.array([1, 5, 4, 6, 0, 9])  # masked: rows 0, 1, 3, 5
    temperature = np.array([0, 0, 0, 1.0, 0, 1.0], np.float32)
    sa = _params(S, sample_index=sample_index, min_tokens=min_tokens, slots=np.arange(S),
                 temperature=temperature, frequency_penalty=np.array([0, 0.5, 0, 0, 0, 0]),
                 want_logprobs=True)
    out, _ = _sample(logits, sa, counts)
    masked = sample_index < min_tokens
    for i in range(S):
        ref = logits[i].astype(np.float64)
        if i == 1:
            ref[40] -= 0.5 * 2
        if masked[i]:
            ref[stops] = -np.inf
        if temperature[i] == 0:
            assert out.tokens[i] == np.argmax(ref), i
        if masked[i]:
            assert out.tokens[i] not in stops, i
    assert out.tokens[2] in stops and out.tokens[4] in stops  # unmasked rows: their argmax
    raw = logits - np.log(np.exp(logits).sum(-1, keepdims=True))  # raw logprobs: unmasked
    np.testing.assert_allclose(out.top_logprobs[:, 0], raw.max(-1), rtol=1e-5, atol=1e-5)
    # Sampling rows never draw a masked stop token, whatever the seed.
    for seed in range(40):
        sa.seeds[:] = np.stack([np.arange(S) + seed * 7, np.full(S, seed)], 1)
        sa.want_logprobs[:] = False
        out, _ = _sample(logits * 0.2, sa, counts)  # flatter: stops not certain anyway
        assert not np.isin(out.tokens[masked], stops).any(), seed


def test_allowed_token_ids_mask_every_other_token_and_load_as_their_own_flag():
    rng = np.random.default_rng(12)
    S = 4
    logits = rng.standard_normal((S, V)).astype(np.float32) * 3
    allowed = [5, 9, 33, 34, 60]
    load = jax.jit(load_token_history)
    counts = jnp.zeros((N_SLOTS + 1, V), jnp.int32)
    for slot in (0, 2):  # rows 0 and 2 restricted (their slots flagged); 1 and 3 free
        counts = load(counts, jnp.int32(slot), jnp.full(8, -1, jnp.int32), jnp.int32(0),
                      _stop_ids(allowed), jnp.bool_(False), jnp.int32(ALLOWED_FLAG))
    c = np.asarray(counts)
    np.testing.assert_array_equal((c[0] & ALLOWED_FLAG) != 0, np.isin(np.arange(V), allowed))
    assert not (c[0] & ~ALLOWED_FLAG).any() and not c[1].any()
    only = np.array([True, False, True, False])
    sa = _params(S, slots=np.arange(S), allowed_only=only, temperature=np.zeros(S),
                 want_logprobs=True)
    out, _ = _sample(logits, sa, c)
    for i in range(S):
        ref = logits[i].astype(np.float64)
        if only[i]:
            ref[~np.isin(np.arange(V), allowed)] = -np.inf
        assert out.tokens[i] == np.argmax(ref), i
    raw = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    np.testing.assert_allclose(out.top_logprobs[:, 0], raw.max(-1), rtol=1e-5, atol=1e-5)
    for seed in range(30):  # sampled rows stay inside the set whatever the seed
        sa.temperature[:] = 1.5
        sa.want_logprobs[:] = False
        sa.seeds[:] = np.stack([np.arange(S) + 5 * seed, np.full(S, seed)], 1)
        out, _ = _sample(logits * 0.1, sa, c)
        assert np.isin(out.tokens[only], allowed).all(), seed


def test_logit_bias_is_added_before_the_penalties_only_on_rows_that_have_it():
    """vLLM v1's order: logits + bias, then the repetition penalty; raw logprobs; a row
    without has_bias ignores its slot's (stale) table; -1 pads and ids >= V do nothing; a
    -100 bias bans a token and +100 forces one under sampling."""
    rng = np.random.default_rng(21)
    S = 4
    logits = rng.standard_normal((S, V)).astype(np.float32) * 3
    bias = LogitBias.zeros(N_SLOTS + 1)
    load = jax.jit(load_logit_bias)
    tables = {0: {int(np.argmax(logits[0])): -4.5, 7: 3.25, 40: 6.0},
              1: {3: 50.0},  # stale: row 1 has no bias
              2: {int(np.argmax(logits[2])): -100.0, 11: 2.5}}
    for slot, b in tables.items():
        ids = np.full(MAX_LOGIT_BIAS, -1, np.int32)
        vals = np.full(MAX_LOGIT_BIAS, 9.0, np.float32)  # pads' values must not matter
        ids[:len(b)], vals[:len(b)] = list(b), list(b.values())
        ids[len(b)] = V + 3  # outside the vocabulary: ignored
        bias = load(bias, jnp.int32(slot), jnp.asarray(ids), jnp.asarray(vals),
                    *table_rows((), ()))
    has = np.array([True, False, True, False])
    counts = np.zeros((N_SLOTS + 1, V), np.int32)
    counts[0, [7, 40]] = PROMPT_FLAG  # seen: the penalty applies to the biased logit
    sa = _params(S, slots=np.arange(S), has_bias=has, temperature=np.zeros(S),
                 repetition_penalty=np.array([1.5, 1.0, 1.0, 1.0], np.float32),
                 want_logprobs=True)
    out, *_ = jax.tree.map(np.asarray, _run(jnp.asarray(logits),
                                           SamplingArrays(*map(jnp.asarray, sa)),
                                           jnp.asarray(counts), None, bias))
    for i in range(S):
        ref = logits[i].astype(np.float64)
        if has[i]:
            for t, v in tables[i].items():
                ref[t] += v
        if i == 0:
            seen = [7, 40]
            ref[seen] = np.where(ref[seen] > 0, ref[seen] / 1.5, ref[seen] * 1.5)
        assert out.tokens[i] == np.argmax(ref), (i, out.tokens[i], np.argmax(ref))
    plain = np.argmax(logits, -1)  # the biases move rows 0 and 2; row 1's stale table not
    assert out.tokens[0] != plain[0] and out.tokens[2] != plain[2]
    assert out.tokens[1] == plain[1] and out.tokens[3] == plain[3]
    raw = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    np.testing.assert_allclose(out.top_logprobs[:, 0], raw.max(-1), rtol=1e-5, atol=1e-5)
    banned, forced = int(np.argmax(logits[2])), 11
    bias = load(bias, jnp.int32(3), jnp.asarray(np.r_[forced, np.full(MAX_LOGIT_BIAS - 1, -1)]
                                                .astype(np.int32)),
                jnp.asarray(np.r_[100.0, np.zeros(MAX_LOGIT_BIAS - 1)].astype(np.float32)),
                *table_rows((), ()))
    sa.has_bias[:] = [False, False, True, True]
    sa.want_logprobs[:] = False
    for seed in range(20):  # sampled: row 2 never draws its banned token, row 3 always 11
        sa.temperature[:] = 1.0
        sa.seeds[:] = np.stack([np.arange(S) + 3 * seed, np.full(S, seed)], 1)
        out, *_ = _run(jnp.asarray(logits * 0.3), SamplingArrays(*map(jnp.asarray, sa)),
                      jnp.asarray(counts), None, bias)
        toks = np.asarray(out.tokens)
        assert toks[2] != banned and toks[3] == forced, (seed, toks)
