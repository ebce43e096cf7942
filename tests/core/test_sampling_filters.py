"""Sort-free cut-offs (sampling_filters) against numpy sorts on random rows with ties, -inf and
+-0, the sampler's host/device decision modes against each other, and the lowered program
(no sort, no conditional when the flags come from the host)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.batch import SamplingArrays
from jaxinfer.sampling import SamplerNeeds, sample_rows
from jaxinfer.sampling_filters import (
    TOPK_FAST,
    TOPK_STAGED,
    key_value,
    kth_largest,
    nucleus_cut,
    order_key,
    top_values,
)


def _tied_rows(rng, S: int, V: int) -> np.ndarray:
    """Rows drawn from few distinct values (many ties), some -inf, some -0.0 / +0.0."""
    x = rng.integers(-6, 7, size=(S, V)).astype(np.float32) * rng.choice([0.5, 1.0, 1.7], S)[
        :, None]
    x[rng.random((S, V)) < 0.15] = -np.inf
    x[rng.random((S, V)) < 0.05] = -0.0
    x[0] = 2.5  # one flat row
    x[1, :] = -np.inf
    x[1, 3] = 1.0  # a single finite value
    return x.astype(np.float32)


def test_order_key_is_monotone_and_invertible():
    rng = np.random.default_rng(0)
    # Normal floats only: XLA flushes subnormals to zero, in comparisons and keys alike.
    x = np.concatenate([rng.standard_normal(500) * 10.0 ** rng.integers(-30, 31, 500),
                        [0.0, -0.0, np.inf, -np.inf, 1.2e-38, -1.2e-38, 3.4e38, -3.4e38]])
    x = x.astype(np.float32)
    k = np.asarray(order_key(jnp.asarray(x)))
    order = np.argsort(k, kind="stable")
    assert np.all(np.diff(x[order]) >= 0)
    assert np.all((k[:, None] < k[None, :]) == (x[:, None] < x[None, :]))
    back = np.asarray(key_value(jnp.asarray(k)))
    np.testing.assert_array_equal(back, np.where(x == 0, 0.0, x))
    assert not np.signbit(back[x == 0]).any()  # -0.0 comes back as +0.0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kth_largest_matches_a_sort(seed):
    rng = np.random.default_rng(seed)
    S, V = 12, 257
    x = _tied_rows(rng, S, V)
    k = rng.integers(1, V + 1, S)
    k[2], k[3] = 1, V
    got = np.asarray(jax.jit(kth_largest)(jnp.asarray(x), jnp.asarray(x.max(-1)),
                                          jnp.asarray(k, jnp.int32)))
    want = -np.sort(-x, axis=-1)[np.arange(S), k - 1]
    np.testing.assert_array_equal(got, want)


def _np_nucleus(x: np.ndarray, k: int, p: float) -> tuple[float, float]:
    """The sort-based rule in float64: (cut, distance of p to the nearest prefix mass)."""
    srt = -np.sort(-x)
    q = np.zeros(len(x))
    finite = np.isfinite(srt[:k])
    q[:k][finite] = np.exp(srt[:k][finite] - srt[0])
    q /= q.sum()
    before = np.cumsum(q) - q
    keep = (np.arange(len(x)) < k) & ((before < p) | (p >= 1.0))
    n = max(int(keep.sum()), 1)
    gap = np.min(np.abs(before[:k] - p)) if p < 1.0 else np.inf
    return float(srt[n - 1]), gap


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_nucleus_cut_keeps_the_same_tokens_as_the_sorted_prefix_rule(seed):
    rng = np.random.default_rng(seed)
    S, V = 16, 300
    x = _tied_rows(rng, S, V)
    x[8:] = (rng.standard_normal((S - 8, V)) * 2.0).astype(np.float32)  # no ties
    k = np.where(rng.random(S) < 0.5, V, rng.integers(1, V + 1, S))
    p = rng.choice([0.05, 0.3, 0.5, 0.77, 0.9, 0.99, 1.0], S).astype(np.float32)
    top = x.max(-1)
    kth = np.where(k < V, -np.sort(-x, axis=-1)[np.arange(S), k - 1], -np.inf)
    f = jax.jit(nucleus_cut)
    got = np.asarray(f(*map(jnp.asarray, (x, top, kth.astype(np.float32), k.astype(np.int32),
                                           p))))
    checked = 0
    for i in range(S):
        want, gap = _np_nucleus(x[i], int(k[i]), float(p[i]))
        if gap < 1e-5:  # p sits on a prefix mass: float32 rounding decides either way
            continue
        np.testing.assert_array_equal(x[i] >= got[i], x[i] >= want, err_msg=f"row {i}")
        checked += 1
    assert checked >= S - 3


@pytest.mark.parametrize("V, K", [(20, 20), (33, 20), (64, 20), (1500, 20), (300, 17),
                                  (300, 48), (300, TOPK_STAGED)])
def test_top_values_equal_lax_top_k_with_ties_and_minus_inf(V, K):
    rng = np.random.default_rng(V + K)
    x = _tied_rows(rng, 6, V)
    x[2, : V - 5] = -np.inf  # fewer finite values than K
    vals, idx = jax.jit(top_values, static_argnums=1)(jnp.asarray(x), K)
    # lax.top_k's order, with -0.0 ranked as +0.0 (documented), values read from x.
    want_idx = np.asarray(jax.lax.top_k(jnp.asarray(np.where(x == 0, 0.0, x)), K)[1])
    np.testing.assert_array_equal(np.asarray(idx), want_idx)
    np.testing.assert_array_equal(np.asarray(vals), np.take_along_axis(x, want_idx, -1))


def _mixed_params(S: int, V: int, rng) -> SamplingArrays:
    sa = SamplingArrays.neutral(S)
    sa.seeds[:] = np.stack([np.arange(S) + 5, np.full(S, 9)], 1)
    sa.sample_index[:] = rng.integers(0, 50, S)
    sa.temperature[:] = rng.choice([0.0, 0.7, 1.0, 1.5], S)
    sa.top_k[:] = rng.choice([0, 3, TOPK_FAST, TOPK_FAST + 5, TOPK_STAGED + 3, V // 2], S)
    sa.top_p[:] = rng.choice([1.0, 0.5, 0.9], S)
    sa.min_p[:] = rng.choice([0.0, 0.05], S)
    sa.repetition_penalty[:] = rng.choice([1.0, 1.3], S)
    sa.frequency_penalty[:] = rng.choice([0.0, 0.4], S)
    sa.slots[:] = np.arange(S)
    sa.want_logprobs[:] = rng.random(S) < 0.5
    return sa


def test_host_flags_device_conds_and_one_program_give_the_same_rows():
    rng = np.random.default_rng(4)
    S, V = 10, 96
    logits = np.round(rng.standard_normal((S, V)) * 3, 1).astype(np.float32)  # ties
    counts = np.zeros((S + 1, V), np.int32)
    counts[:S, :20] = rng.integers(0, 3, (S, 20))
    for trial in range(3):
        sa = _mixed_params(S, V, rng)
        if trial == 2:  # a batch that needs only some parts
            sa.top_k[:], sa.repetition_penalty[:], sa.frequency_penalty[:] = 0, 1.0, 0.0
        args = (jnp.asarray(logits), SamplingArrays(*map(jnp.asarray, sa)), jnp.asarray(counts))
        outs = [jax.jit(sample_rows, static_argnums=3)(*args, needs)
                for needs in (None, SamplerNeeds.of(sa, V), SamplerNeeds())]
        for a, b in zip(outs[0], outs[1]):
            jax.tree.map(np.testing.assert_array_equal, a, b)
        for a, b in zip(outs[0], outs[2]):
            jax.tree.map(np.testing.assert_array_equal, a, b)
    assert SamplerNeeds.of(sa, V) != SamplerNeeds()


def test_needs_of_a_batch():
    V = 1000
    sa = SamplingArrays.neutral(4)
    assert SamplerNeeds.of(sa, V) == SamplerNeeds(*[False] * 5)
    sa.top_p[:], sa.top_k[:] = 0.5, 3  # greedy rows: their filters do not count
    assert SamplerNeeds.of(sa, V) == SamplerNeeds(*[False] * 5)
    sa.top_k[:] = 0
    sa.temperature[1] = 1.0
    n = SamplerNeeds.of(sa, V)
    assert n.sampling and n.top_p_search and not n.top_k_search
    sa.top_k[2], sa.temperature[2] = 5, 0.5
    n = SamplerNeeds.of(sa, V)
    assert n.top_k_search and not n.penalties and not n.logprobs
    sa.top_k[2] = V  # top_k >= V keeps everything: no search
    assert not SamplerNeeds.of(sa, V).top_k_search


def _lowered(needs, V=4096, S=8) -> str:
    sds = jax.ShapeDtypeStruct
    sa = SamplingArrays(*(sds(a.shape, a.dtype) for a in SamplingArrays.neutral(S)))
    return jax.jit(sample_rows, static_argnums=3).lower(
        sds((S, V), jnp.float32), sa, sds((S + 1, V), jnp.int32), needs).as_text()


def test_static_program_has_no_sort_no_conditional_and_only_small_top_k():
    text = _lowered(SamplerNeeds())
    assert "stablehlo.sort" not in text
    assert "stablehlo.case" not in text and "stablehlo.if" not in text
    ks = [int(k) for k in re.findall(r"top_k\(.*?k = (\d+)", text)]
    assert ks and max(ks) <= TOPK_FAST
    # Deciding on the device is what puts conditionals in the program.
    assert "stablehlo.case" in _lowered(None) or "stablehlo.if" in _lowered(None)
