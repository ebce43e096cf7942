"""Sort-free cut-offs and top values (sampling_filters, sampling_topk) against numpy sorts on
random rows with ties, -inf and +-0, the sampler's host/device decision modes against each
other, and the lowered program (no sort, no conditional when the flags come from the host)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.batch import SamplingArrays
from jaxinfer.order_keys import key_value, order_key
from jaxinfer.sampling import SamplerNeeds, sample_rows
from jaxinfer.sampling_filters import BUFFER_TOP_K, kth_largest, nucleus_cut
from jaxinfer.sampling_topk import TOPK_FAST, TOPK_STAGED, top_values


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
    assert SamplerNeeds.of(sa, V) == SamplerNeeds(*[False] * len(SamplerNeeds._fields))
    sa.top_p[:], sa.top_k[:] = 0.5, 3  # greedy rows: their filters do not count
    assert SamplerNeeds.of(sa, V) == SamplerNeeds(*[False] * len(SamplerNeeds._fields))
    sa.top_k[:] = 0
    sa.temperature[1] = 1.0
    n = SamplerNeeds.of(sa, V)
    assert n.sampling and n.top_p_search and not n.top_k_search
    assert n.full_search  # top-p without top-k: the nucleus is searched over the vocabulary
    sa.top_k[2], sa.temperature[2] = 5, 0.5
    n = SamplerNeeds.of(sa, V)
    assert n.top_k_search and not n.penalties and not n.logprobs
    sa.top_k[2] = V  # top_k >= V keeps everything: no search
    assert not SamplerNeeds.of(sa, V).top_k_search
    sa.top_k[1], sa.top_k[2] = 5, BUFFER_TOP_K  # small top-k on every filtering row
    assert not SamplerNeeds.of(sa, V).full_search
    sa.top_k[2] = BUFFER_TOP_K + 1
    assert SamplerNeeds.of(sa, V).full_search


def _lowered(needs, V=4096, S=8) -> str:
    sds = jax.ShapeDtypeStruct
    sa = SamplingArrays(*(sds(a.shape, a.dtype) for a in SamplingArrays.neutral(S)))
    # A fresh function each time: jit's trace cache would not see the module's tunables.
    return jax.jit(lambda *a: sample_rows(*a), static_argnums=3).lower(
        sds((S, V), jnp.float32), sa, sds((S + 1, V), jnp.int32), needs).as_text()


def test_static_program_has_no_sort_no_conditional_and_only_small_top_k(monkeypatch):
    """With the buffer searched (BUFFER_METHOD "search") and chunks ranked by TopK stages
    (SELECT_METHOD "topk") the program has no sort at all; the "sort" methods' sorts (the
    defaults) are test_sort_method_sorts_only_the_buffer and test_sampling_noise's."""
    from jaxinfer import sampling_filters as sf
    from jaxinfer import sampling_topk as topk

    monkeypatch.setattr(sf, "BUFFER_METHOD", "search")
    monkeypatch.setattr(topk, "SELECT_METHOD", "topk")
    text = _lowered(SamplerNeeds())
    assert "stablehlo.sort" not in text
    assert "stablehlo.case" not in text and "stablehlo.if" not in text
    ks = [int(k) for k in re.findall(r"top_k\(.*?k = (\d+)", text)]
    assert ks and max(ks) <= TOPK_FAST
    # Deciding on the device is what puts conditionals in the program.
    assert "stablehlo.case" in _lowered(None) or "stablehlo.if" in _lowered(None)


def _np_kept(x: np.ndarray, k: int, p: float) -> tuple[np.ndarray, float]:
    """Kept set of top-k (k <= 0 or >= V: off) then top-p by a sort, in float64, and the
    distance of p to the nearest prefix mass (float32 rounding decides a cut that close)."""
    V = len(x)
    k = k if 0 < k < V else V
    cut, _ = _np_nucleus(x, k, p)
    srt = -np.sort(-x)[:k]
    q = np.where(np.isfinite(srt), np.exp(srt - srt[0]), 0.0)
    before = (np.cumsum(q) - q)[1:] / q.sum()  # the first prefix mass, 0, is exact
    gap = np.min(np.abs(before - p), initial=np.inf) if p < 1.0 else np.inf
    return x >= cut, gap


METHODS = ("search", "sort", "topk")  # sampling_filters.BUFFER_METHODS


def test_buffer_methods_are_the_module_s():
    from jaxinfer import sampling_filters as sf

    assert sf.BUFFER_METHODS == METHODS and sf.BUFFER_METHOD == "sort"  # the H200's fastest


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("seed, dtype", [(0, np.float32), (1, np.float32), (2, "bfloat16"),
                                         (3, "bfloat16")])
def test_cutoffs_keep_the_sorted_sets_with_small_chunks(seed, dtype, method, monkeypatch):
    """The sampler's cut-offs (buffered for small top-k, full search otherwise) on fresh
    random rows with ties, -inf, +-0, keep exactly the tokens a sort keeps, whichever
    BUFFER_METHOD decides in the buffer. Chunks of 4 so that the top-chunk selection is
    exercised at V = 300 (CHUNK = 128 covers the row there)."""
    from jaxinfer import sampling, sampling_filters, sampling_topk

    monkeypatch.setattr(sampling_filters, "BUFFER_METHOD", method)
    monkeypatch.setattr(sampling_topk, "CHUNK", 4)
    monkeypatch.setattr(sampling_topk, "TOPK_MIN_N", 0)  # keep chunks of 4 at V = 300
    monkeypatch.setattr(sampling_filters, "BUFFER_TOP_K", 24)
    rng = np.random.default_rng(100 + seed)
    S, V = 24, 300
    x = _tied_rows(rng, S, V)
    x[12:] = (rng.standard_normal((S - 12, V)) * 3.0).astype(np.float32)  # no ties
    x = np.asarray(jnp.asarray(x, dtype).astype(jnp.float32))  # bf16 logits, computed in f32
    k = rng.choice([0, 1, 2, 7, 23, 24, 25, 60, V - 1, V, V + 5], S)
    k[:4] = [1, 24, V, 0]
    p = rng.choice([1e-7, 0.05, 0.5, 0.9, 0.99, 1.0], S).astype(np.float32)
    sp = SamplingArrays.neutral(S)
    sp.temperature[:], sp.top_k[:], sp.top_p[:] = 1.0, k, p
    needs = SamplerNeeds.of(sp, V)
    assert needs.top_k_search and needs.full_search

    def cut(scaled, sa):
        return sampling._cutoff(scaled, jnp.max(scaled, -1), sa,
                                lambda name, f, g: f() if getattr(needs, name) else g())

    got = np.asarray(jax.jit(cut)(jnp.asarray(x), SamplingArrays(*map(jnp.asarray, sp))))
    checked = 0
    for i in range(S):
        want, gap = _np_kept(x[i], int(k[i]), float(p[i]))
        if gap < 1e-5:
            continue
        np.testing.assert_array_equal(x[i] >= got[i], want, err_msg=f"row {i}")
        checked += 1
    assert checked >= S - 4


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("seed", [0, 1])
def test_buffered_kth_and_nucleus_equal_the_full_search(seed, method, monkeypatch):
    """buffered_cutoffs (top chunks only) against kth_largest / nucleus_cut over the row, for
    every k up to the buffer's, on tied rows (the k-th value exactly; the cut's kept set),
    whichever BUFFER_METHOD decides in the buffer."""
    from jaxinfer import sampling_filters as sf
    from jaxinfer import sampling_topk as topk

    monkeypatch.setattr(sf, "BUFFER_METHOD", method)

    rng = np.random.default_rng(seed)
    S, V, n = 16, 203, 9  # 203 = 50 chunks of 4 + a padded one
    x = _tied_rows(rng, S, V)
    x[8:] = (rng.standard_normal((S - 8, V)) * 2.0).astype(np.float32)
    k = rng.integers(1, n + 1, S).astype(np.int32)
    k[:3] = [1, n, n]
    p = rng.choice([1e-7, 0.3, 0.8, 1.0], S).astype(np.float32)
    top = x.max(-1)
    monkeypatch.setattr(topk, "CHUNK", 4)
    monkeypatch.setattr(topk, "TOPK_MIN_N", 0)
    args = tuple(map(jnp.asarray, (x, top, k, p)))
    kth_b, cut_b = jax.jit(lambda x, t, k, p: sf.buffered_cutoffs(x, t, k, p, n))(*args)
    kth_f = jax.jit(sf.kth_largest)(*args[:3])
    cut_f = jax.jit(sf.nucleus_cut)(args[0], args[1], kth_f, args[2], args[3])
    want_kth = -np.sort(-x, axis=-1)[np.arange(S), k - 1]
    np.testing.assert_array_equal(np.asarray(kth_b), want_kth)
    np.testing.assert_array_equal(np.asarray(kth_f), want_kth)
    for i in range(S):
        want, gap = _np_nucleus(x[i], int(k[i]), float(p[i]))
        if gap < 1e-5:
            continue
        np.testing.assert_array_equal(x[i] >= np.asarray(cut_b)[i], x[i] >= want)
        np.testing.assert_array_equal(x[i] >= np.asarray(cut_f)[i], x[i] >= want)


@pytest.mark.parametrize("method", METHODS)
def test_buffer_methods_agree_and_rows_do_not_depend_on_their_batch(method, monkeypatch):
    """Every BUFFER_METHOD gives the k-th value of the search bit for bit and the search's
    kept set, on rows with ties, -inf, +-0 and k = 1, k = n, p -> 0 and p = 1; a row's
    cut-offs alone equal its cut-offs in the batch, bit for bit."""
    from jaxinfer import sampling_filters as sf
    from jaxinfer import sampling_topk as topk

    rng = np.random.default_rng(7)
    S, V, n = 12, 203, 9
    x = _tied_rows(rng, S, V)
    x[6:] = (rng.standard_normal((S - 6, V)) * 2.0).astype(np.float32)
    x[4, ::3] = -0.0  # many -0.0 / +0.0 ties at the top
    x[4, 1::3] = 0.0
    k = rng.integers(1, n + 1, S).astype(np.int32)
    k[:4] = [1, n, n, 1]
    p = rng.choice([1e-7, 0.3, 0.8, 1.0], S).astype(np.float32)
    p[:4] = [1e-7, 1.0, 1e-7, 1.0]
    args = tuple(map(jnp.asarray, (x, x.max(-1), k, p)))
    monkeypatch.setattr(topk, "CHUNK", 4)
    monkeypatch.setattr(topk, "TOPK_MIN_N", 0)

    def run(m, *a):
        monkeypatch.setattr(sf, "BUFFER_METHOD", m)
        return [np.asarray(v) for v in jax.jit(lambda x, t, k, p: sf.buffered_cutoffs(
            x, t, k, p, n))(*a)]

    kth_s, cut_s = run("search", *args)
    kth_m, cut_m = run(method, *args)
    np.testing.assert_array_equal(kth_m, kth_s)
    assert not np.signbit(kth_m[kth_m == 0]).any()  # -0.0 comes back as +0.0
    for i in range(S):
        want, gap = _np_nucleus(x[i], int(k[i]), float(p[i]))
        if gap < 1e-5:
            continue
        np.testing.assert_array_equal(x[i] >= cut_m[i], x[i] >= cut_s[i], err_msg=f"row {i}")
    for i in (0, 5, 11):
        alone = run(method, *(a[i:i + 1] for a in args))
        np.testing.assert_array_equal(alone[0][0], kth_m[i])
        np.testing.assert_array_equal(alone[1][0], cut_m[i])


@pytest.mark.parametrize("select", ["topk", "sort"])
@pytest.mark.parametrize("method", ["sort", "topk"])
def test_sort_method_sorts_only_the_buffer(method, select, monkeypatch):
    """BUFFER_METHOD "sort": one sort, of the [S, BUFFER_TOP_K * chunk] buffer (no
    vocabulary sort); "topk": no sort, lax.top_k of at most TOPK_FAST. SELECT_METHOD "sort"
    (the default) adds one sort of the chunk maxima (padded to the buffer's width at most)
    and takes no TopK stage for the chunks; neither sorts anything of the vocabulary's size."""
    from jaxinfer import sampling_filters as sf
    from jaxinfer import sampling_topk as topk

    monkeypatch.setattr(sf, "BUFFER_METHOD", method)
    monkeypatch.setattr(topk, "SELECT_METHOD", select)
    S, V = 8, 128256
    text = _lowered(SamplerNeeds(full_search=False, logprobs=False), V=V, S=S)
    sorts = re.findall(r"stablehlo.sort.*?\) -> tensor<(\d+)x(\d+)x(?:f32|ui32)>", text, re.S)
    ks = [int(k) for k in re.findall(r"top_k\(.*?k = (\d+)", text)]
    width = BUFFER_TOP_K * topk.chunk_size(V)
    n_sorts = (method == "sort") + (select == "sort")
    assert text.count("stablehlo.sort") == n_sorts
    assert [tuple(map(int, s)) for s in sorts] == [(S, width)] * n_sorts
    if method == "topk" or select == "topk":
        assert ks and max(ks) <= TOPK_FAST
    else:
        assert not ks


@pytest.mark.parametrize("pivots", [1, 2, 3, 7, 15, 31])
def test_search_is_exact_for_any_pivot_count(pivots):
    rng = np.random.default_rng(pivots)
    S, V = 8, 129
    x = _tied_rows(rng, S, V)
    k = rng.integers(1, V + 1, S).astype(np.int32)
    got = jax.jit(kth_largest, static_argnums=3)(jnp.asarray(x), jnp.asarray(x.max(-1)),
                                                 jnp.asarray(k), pivots)
    np.testing.assert_array_equal(np.asarray(got), -np.sort(-x, axis=-1)[np.arange(S), k - 1])


@pytest.mark.parametrize("V, K, chunk", [(300, 20, 4), (301, 20, 4), (257, 16, 8),
                                         (1500, 20, 16), (300, 48, 2)])
def test_chunked_top_values_equal_lax_top_k(V, K, chunk, monkeypatch):
    """top_values through the K best chunks: lax.top_k's indices (ties to the lower index,
    -0.0 as +0.0), on tied rows and rows with fewer finite values than K."""
    from jaxinfer import sampling_topk as topk

    monkeypatch.setattr(topk, "CHUNK", chunk)
    monkeypatch.setattr(topk, "TOPK_MIN_N", 0)
    rng = np.random.default_rng(V + K + chunk)
    x = _tied_rows(rng, 6, V)
    x[2, : V - 5] = -np.inf
    x[3] = np.round(rng.standard_normal(V), 0).astype(np.float32)  # few values, many ties
    vals, idx = jax.jit(topk.top_values, static_argnums=1)(jnp.asarray(x), K)
    want_idx = np.asarray(jax.lax.top_k(jnp.asarray(np.where(x == 0, 0.0, x)), K)[1])
    np.testing.assert_array_equal(np.asarray(idx), want_idx)
    np.testing.assert_array_equal(np.asarray(vals), np.take_along_axis(x, want_idx, -1))


def test_chunk_size_keeps_xla_gpu_topk_rows_long_enough():
    """At V = 128256 chunks of 64 (2004 maxima, a 1280-element top-20 buffer: both >= 1024,
    XLA:GPU's TopK kernel, no sort); smaller vocabularies get shorter chunks."""
    from jaxinfer import sampling_topk as topk

    assert topk.chunk_size(128256) == 64 and topk.chunk_size(32000) == 16
    assert -(-128256 // 64) >= topk.TOPK_MIN_N and 20 * 64 >= topk.TOPK_MIN_N
    assert topk.chunk_size(100) == 1
