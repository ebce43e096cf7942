"""The sampler's draw candidates (issue #7): DRAW_METHOD "hash" (counter-hash Gumbel noise,
jaxinfer/sampling_noise.py) and SELECT_METHOD "sort" (jaxinfer/sampling_topk.py) --
distribution of the draws against the filtered distribution, independence of consecutive
draws, seeded invariance across batches and buckets, and equality of the selections."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jaxinfer import sampling
from jaxinfer import sampling_filters as sf
from jaxinfer import sampling_topk as topk
from jaxinfer.batch import SamplingArrays
from jaxinfer.sampling_noise import bits_to_uniform, hash_uniform, row_words

P_MIN = 1e-4  # chi-square p-value below which a draw is called biased


@pytest.fixture
def hashed(monkeypatch):
    monkeypatch.setattr(sampling, "DRAW_METHOD", "hash")
    monkeypatch.setattr(topk, "SELECT_METHOD", "sort")


def _rows(S: int, V: int, index, **kw) -> SamplingArrays:
    sa = SamplingArrays.neutral(S)
    sa.seeds[:] = [7, 9]
    sa.sample_index[:] = index
    for name, v in kw.items():
        getattr(sa, name)[...] = v
    return sa


_JITS: dict = {}


def _tokens(logits: np.ndarray, sa: SamplingArrays, counts=None) -> np.ndarray:
    """sample_rows' tokens, jitted once per (DRAW_METHOD, SELECT_METHOD): a fresh callable,
    as jit's trace cache does not see module switches."""
    S, V = logits.shape
    counts = np.zeros((S + 1, V), np.int32) if counts is None else counts
    key = (sampling.DRAW_METHOD, topk.SELECT_METHOD)
    if key not in _JITS:
        _JITS[key] = jax.jit(lambda *a: sampling.sample_rows(*a))
    out, *_ = _JITS[key](jnp.asarray(logits, jnp.float32), SamplingArrays(*map(jnp.asarray, sa)),
                         jnp.asarray(counts))
    return np.asarray(out.tokens)


def test_uniforms_are_inside_the_open_interval_at_the_extreme_bits():
    """The largest and smallest hash words give uniforms strictly inside (0, 1) and finite
    Gumbel noise (24 bits would round the largest to 1.0: +inf noise, a NaN on a masked
    token, drawn by argmax)."""
    h = jnp.asarray([0, 1, 511, 512, 0xFFFFFE00, 0xFFFFFFFF], jnp.uint32)
    u = np.asarray(bits_to_uniform(h))
    assert ((u > 0) & (u < 1)).all() and u[-1] == np.float32(1 - 2.0 ** -24)
    assert np.isfinite(-np.log(-np.log(u))).all()


def test_hash_uniforms_are_uniform_and_keyed():
    words = row_words(jnp.asarray([[1, 2], [1, 3]], jnp.uint32), jnp.asarray([0, 0]))
    u = np.asarray(hash_uniform(words, 1 << 16))
    assert ((u > 0) & (u < 1)).all()
    for row in u:
        assert stats.kstest(row, "uniform").pvalue > P_MIN
    assert np.corrcoef(u[0], u[1])[0, 1] < 0.02  # another seed word: another stream


@pytest.mark.parametrize("kw, keep", [
    (dict(temperature=1.0), 16),  # plain temperature: every token
    (dict(temperature=0.7, top_k=5), 5),
    (dict(temperature=1.3, top_p=0.8), None),
    (dict(temperature=1.0, min_p=0.1, top_k=12, top_p=0.9), None),
])
def test_hash_draws_follow_the_filtered_distribution(hashed, kw, keep):
    """4000 draws of one row (one seed, sample indices 0..3999) against the exact filtered
    distribution: chi-square over the kept tokens, and no excluded token drawn."""
    V, n = 16, 4000
    logits = np.log(np.linspace(1.0, 3.0, V))[::-1] * 2  # distinct, decreasing
    sa = _rows(n, V, np.arange(n), **kw)
    got = np.bincount(_tokens(np.tile(logits, (n, 1)), sa), minlength=V)
    x = logits / kw["temperature"]
    p = np.exp(x - x.max())
    p = np.where(p >= kw.get("min_p", 0.0), p, 0.0)
    p[kw.get("top_k", V):] = 0.0
    p /= p.sum()
    if "top_p" in kw:  # sorted already: keep positions whose preceding mass is below top_p
        p = np.where(np.cumsum(p) - p < kw["top_p"], p, 0.0)
        p /= p.sum()
    kept = p > 0
    assert keep is None or kept.sum() == keep
    assert got[~kept].sum() == 0
    assert stats.chisquare(got[kept], n * p[kept]).pvalue > P_MIN


def test_hash_draws_of_consecutive_indices_are_independent(hashed):
    """Tokens at sample index i and i + 1 (one seed): the 2-D contingency table is
    consistent with independence."""
    V, n = 6, 3000
    logits = np.log(np.array([0.3, 0.2, 0.2, 0.15, 0.1, 0.05]))
    t = _tokens(np.tile(logits, (n + 1, 1)), _rows(n + 1, V, np.arange(n + 1),
                                                  temperature=1.0))
    table = np.zeros((V, V))
    np.add.at(table, (t[:-1], t[1:]), 1)
    assert stats.chi2_contingency(table).pvalue > P_MIN


def test_hash_draws_ignore_neighbours_and_buckets(hashed):
    """A seeded row's token is the same alone, at any row of larger buckets, next to greedy,
    penalized and differently filtered neighbours (V = 4096: the chunk buffer is used)."""
    rng = np.random.default_rng(5)
    V = 4096
    kw = dict(temperature=0.9, top_k=40, top_p=0.9, min_p=0.01, repetition_penalty=1.2)
    row = rng.standard_normal(V).astype(np.float32) * 3
    for index in range(6):
        alone = _rows(1, V, index, **kw)
        ref = _tokens(row[None], alone)[0]
        for S, at in ((8, 5), (32, 0), (32, 31)):
            logits = rng.standard_normal((S, V)).astype(np.float32) * 3
            logits[at] = row
            sa = _rows(S, V, rng.integers(0, 50, S), temperature=rng.choice([0.0, 1.0], S),
                       top_p=rng.choice([1.0, 0.5], S), top_k=rng.choice([0, 3, 100], S))
            sa.seeds[:] = rng.integers(0, 1000, (S, 2))
            for name, v in kw.items():
                getattr(sa, name)[at] = v
            sa.seeds[at], sa.sample_index[at] = [7, 9], index
            assert _tokens(logits, sa)[at] == ref
        greedy = _rows(1, V, index)
        assert _tokens(row[None], greedy)[0] == row.argmax()


def test_select_sort_matches_topk_stages(monkeypatch):
    """top_chunks and top_values pick the same chunks, ids and values with SELECT_METHOD
    "sort" as with the TopK stages, ties included (values rounded to 0.1, -0.0 present)."""
    rng = np.random.default_rng(1)
    x = np.round(rng.standard_normal((3, 128256)) * 3, 1).astype(np.float32)
    x[1, ::7] = -0.0
    x[2, :5000] = 9.0  # many ties at the top
    got = {}
    for m in topk.SELECT_METHODS:
        monkeypatch.setattr(topk, "SELECT_METHOD", m)
        f = jax.jit(lambda x: (topk.top_chunks(x, 64), topk.top_values(x, 20)))
        got[m] = jax.tree.map(np.asarray, f(jnp.asarray(x)))
    for a, b in zip(jax.tree.leaves(got["topk"]), jax.tree.leaves(got["sort"])):
        np.testing.assert_array_equal(a, b)
    _, idx = got["sort"][1]
    ref = np.argsort(-x, axis=1, kind="stable")[:, :20]
    np.testing.assert_array_equal(idx, ref)


def test_unknown_methods_raise(monkeypatch):
    monkeypatch.setattr(sampling, "DRAW_METHOD", "philox")
    with pytest.raises(ValueError, match="DRAW_METHOD"):
        _tokens(np.zeros((1, 8)), _rows(1, 8, 0, temperature=1.0))


@pytest.mark.parametrize("impl", ["jnp", "pallas"])
def test_nucleus_floor_gives_the_same_cut(monkeypatch, impl):
    """NUCLEUS_FLOOR starts the nucleus search at nucleus_floor: the cut is the same, bit for
    bit, as from kth (jnp search and the Pallas kernel in interpret mode), for rows with and
    without top-k, top_p from tiny to 1, -inf entries, logits around 0 and around 20; and the
    floor passes (mass above it >= top_p * mass(top k), numpy float64)."""
    rng = np.random.default_rng(4)
    S, V = 12, 3000
    x = (rng.standard_normal((S, V)) * 3 + rng.choice([0.0, 20.0], S)[:, None])
    x[rng.random((S, V)) < 0.1] = -np.inf
    x = x.astype(np.float32)
    k = np.where(rng.random(S) < 0.5, rng.integers(1, 200, S), V).astype(np.int32)
    p = rng.choice([0.05, 0.5, 0.9, 0.96, 0.99, 1.0], S).astype(np.float32)
    srt = -np.sort(-x, axis=1)
    kth = np.where(k < V, srt[np.arange(S), k - 1], -np.inf).astype(np.float32)
    monkeypatch.setattr(sf, "SEARCH_IMPL", impl)
    args = [jnp.asarray(a) for a in (x, x.max(1), kth, k, p)]
    cuts = {}
    for floor in (False, True):
        monkeypatch.setattr(sf, "NUCLEUS_FLOOR", floor)
        cuts[floor] = np.asarray(jax.jit(lambda *a: sf.nucleus_cut(*a))(*args))
    np.testing.assert_array_equal(cuts[True], cuts[False])
    lo = np.asarray(sf.nucleus_floor(*args[1:]))
    assert (lo > kth).sum() >= S // 3  # the floor is above kth on many rows (not vacuous)
    w = np.exp(srt.astype(np.float64) - x.max(1, keepdims=True))
    for i in range(S):
        mass_k = w[i, :k[i]].sum()
        assert w[i][srt[i] >= lo[i]].sum() >= p[i] * mass_k * (1 - 1e-9) or lo[i] == kth[i]
