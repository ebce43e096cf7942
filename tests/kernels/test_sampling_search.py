"""Pallas threshold search (pallas_kernels/sampling, interpret mode on CPU) against the jnp search
of jaxinfer.sampling_filters on fresh random rows: ties, -inf rows, +-0, k = 1 and k = V,
top_p = 1 and tiny top_p, V not a multiple of the kernel's loop step nor of its segment. The
k-th value must be equal bit for bit; the nucleus cut keeps the same tokens wherever top_p is
not within float32 rounding of a prefix mass (the jnp search's own tolerance,
tests/core/test_sampling_filters.py). The split mode (a launch per pass) must give the
one-launch mode's values bit for bit. A last group lowers the kernels for CUDA on this machine
(Triton lowering errors) and checks the sampler's dispatch (sampling_filters.SEARCH_IMPL)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import sampling_filters as sf
from jaxinfer.order_keys import order_key
from pallas_kernels.sampling import threshold_search as ts
from tests.kernels.cuda_lowering import lower_for_cuda

# Loop steps of 256 elements, segments of 512: several of each per row, one launch per search.
SMALL = {"block": 128, "unroll": 2, "segment": 512, "split": False, "interpret": True}


def _rows(seed: int, S: int, V: int) -> np.ndarray:
    """Tied rows (few distinct values, -inf, -0.0 / +0.0), a flat row, an all -inf row, one
    finite value, and rows of distinct normal values."""
    rng = np.random.default_rng(seed)
    x = rng.integers(-6, 7, size=(S, V)).astype(np.float32) * rng.choice([0.5, 1.7], S)[:, None]
    x[rng.random((S, V)) < 0.15] = -np.inf
    x[rng.random((S, V)) < 0.05] = -0.0
    x[0] = 2.5
    x[1] = -np.inf
    x[2] = -np.inf
    x[2, V - 1] = 1.0  # the only finite value, in the masked tail's last step
    x[S // 2:] = rng.standard_normal((S - S // 2, V)) * 3.0
    return x.astype(np.float32)


def _args(x, *rest):
    return tuple(jnp.asarray(a) for a in (x, x.max(-1), *rest))


@pytest.mark.parametrize("V, pivots", [(1000, 3), (4099, 7), (512, 15)])
def test_kth_largest_equals_the_jnp_search_bit_for_bit(V, pivots):
    S = 8
    x = _rows(V, S, V)
    k = np.random.default_rng(V + 1).integers(1, V + 1, S).astype(np.int32)
    k[:4] = [1, V, 3, V]
    k[5] = 1
    args = _args(x, k)
    got = np.asarray(ts.kth_largest(*args, pivots=pivots, **SMALL))
    want = np.asarray(jax.jit(sf.kth_largest)(*args))
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.signbit(got), np.signbit(want))  # +0.0, never -0.0
    np.testing.assert_array_equal(want, -np.sort(-x, axis=-1)[np.arange(S), k - 1])


def test_kth_largest_at_the_default_step_pivot_counts_and_out_of_range_k():
    """Default block / unroll, one segment (V = 4096: unmasked loads; V = 1500: a tail); every
    pivot count gives the same value; k <= 0 gives the maximum, k > V -inf (as jnp)."""
    for V, pivots in ((4096, (1, 7)), (1500, (2,))):
        x = _rows(V, 4, V)
        k = np.array([0, 7, V + 3, V // 2], np.int32)
        args = _args(x, k)
        want = np.asarray(jax.jit(sf.kth_largest)(*args))
        assert want[0] == x[0].max() and want[2] == -np.inf
        for P in pivots:
            got = ts.kth_largest(*args, pivots=P, segment=4096, interpret=True)
            np.testing.assert_array_equal(np.asarray(got), want, err_msg=f"V={V} P={P}")


def _np_kept(x: np.ndarray, k: int, p: float) -> tuple[np.ndarray, float]:
    """Tokens top-k then top-p keep by a float64 sort, and the distance of p to the nearest
    prefix mass (float32 rounding decides a cut that close)."""
    srt = -np.sort(-x)[:k]
    if srt[0] == -np.inf:  # nothing finite: the cut is -inf, everything is kept
        return np.ones(len(x), bool), np.inf
    q = np.where(np.isfinite(srt), np.exp(srt - srt[0]), 0.0)
    q /= q.sum()
    before = np.cumsum(q) - q
    n = max(int(((before < p) | (p >= 1.0)).sum()), 1)
    gap = np.min(np.abs(before[1:] - p), initial=np.inf) if p < 1.0 else np.inf
    return x >= srt[n - 1], gap


@pytest.mark.parametrize("V, pivots", [(1000, 3), (2051, 7)])
def test_nucleus_cut_keeps_the_jnp_search_s_tokens(V, pivots):
    S = 10
    rng = np.random.default_rng(V)
    x = _rows(V + 5, S, V)
    k = np.where(rng.random(S) < 0.5, V, rng.integers(1, V + 1, S)).astype(np.int32)
    p = rng.choice([1e-7, 0.3, 0.9, 0.99, 1.0], S).astype(np.float32)
    k[:3], p[:3] = [V, V, 5], [0.9, 0.5, 0.7]  # flat row, all -inf row, one finite value
    p[5:7] = [1.0, 1e-7]
    xs, top, kk, pp = _args(x, k, p)
    kth = jnp.where(kk < V, jax.jit(sf.kth_largest)(xs, top, kk), -jnp.inf)
    want = np.asarray(jax.jit(sf.nucleus_cut)(xs, top, kth, kk, pp))
    got = np.asarray(ts.nucleus_cut(xs, top, kth, kk, pp, pivots=pivots, **SMALL))
    kth = np.asarray(kth)
    np.testing.assert_array_equal(got[p >= 1.0], kth[p >= 1.0])  # top_p 1: the k-th value
    np.testing.assert_array_equal(got[6], x[6].max())  # tiny top_p: the best token alone
    np.testing.assert_array_equal(got[1], -np.inf)
    checked = 0
    for i in range(S):
        kept, gap = _np_kept(x[i], int(k[i]), float(p[i]))
        if gap < 1e-5:
            continue
        np.testing.assert_array_equal(x[i] >= got[i], kept, err_msg=f"row {i}")
        np.testing.assert_array_equal(got[i], want[i], err_msg=f"row {i}")
        checked += 1
    assert checked >= S - 3


def test_a_row_s_cuts_do_not_depend_on_its_batch_nor_on_the_pivot_count():
    V = 700
    x = _rows(3, 6, V)
    k = np.array([V, 5, V, 40, V, 300], np.int32)
    p = np.array([0.5, 0.9, 0.3, 0.8, 0.95, 0.6], np.float32)
    xs, top, kk, pp = _args(x, k, p)
    kth = ts.kth_largest(xs, top, jnp.where(kk < V, kk, 0), **SMALL)
    kth = jnp.where(kk < V, kth, -jnp.inf)
    cut = np.asarray(ts.nucleus_cut(xs, top, kth, kk, pp, pivots=3, **SMALL))
    np.testing.assert_array_equal(
        np.asarray(ts.nucleus_cut(xs, top, kth, kk, pp, pivots=15, **SMALL)), cut)
    for i in (1, 4):
        one = ts.nucleus_cut(*(a[i:i + 1] for a in (xs, top, kth, kk, pp)), pivots=3, **SMALL)
        np.testing.assert_array_equal(np.asarray(one)[0], cut[i])


def test_split_mode_equals_the_one_launch_mode_bit_for_bit():
    """Rows split over programs (segments of 256, one launch per pass, the previous pass's
    segment sums reduced in the next launch): the same k-th values and cuts as one launch
    (without compaction: the split mode does not compact; tested below)."""
    V, S = 1000, 5
    x = _rows(21, S, V)
    k = np.array([V, 9, 1, 300, V], np.int32)
    p = np.array([0.7, 0.9, 0.5, 1.0, 1e-7], np.float32)
    xs, top, kk, pp = _args(x, k, p)
    geo = {"block": 64, "unroll": 2, "segment": 256, "pivots": 7, "interpret": True}
    kth = {m: ts.kth_largest(xs, top, kk, split=m, **geo) for m in (False, True)}
    np.testing.assert_array_equal(np.asarray(kth[True]), np.asarray(kth[False]))
    np.testing.assert_array_equal(np.asarray(kth[True]), np.asarray(sf.kth_largest(xs, top, kk)))
    kth_n = jnp.where(kk < V, kth[False], -jnp.inf)
    cut = {m: np.asarray(ts.nucleus_cut(xs, top, kth_n, kk, pp, split=m, compact=0, **geo))
           for m in (False, True)}
    np.testing.assert_array_equal(cut[True], cut[False])
    np.testing.assert_array_equal(cut[True][3], np.asarray(kth_n)[3])  # top_p 1
    np.testing.assert_array_equal(cut[True][4], x[4].max())  # tiny top_p


def test_bad_inputs_raise():
    x = jnp.zeros((2, 8), jnp.float32)
    with pytest.raises(ValueError, match="float32"):
        ts.kth_largest(x.astype(jnp.bfloat16), x[:, 0], jnp.ones(2, jnp.int32))
    with pytest.raises(ValueError, match=r"operand 1 must be \[2\]"):
        ts.kth_largest(x, x[:, 0], jnp.ones(3, jnp.int32))
    with pytest.raises(ValueError, match="multiple of block"):
        ts.kth_largest(x, x[:, 0], jnp.ones(2, jnp.int32), segment=1000)


def test_default_pivots_and_the_lower_bound_key():
    assert ts.default_pivots(1) == 3 and ts.default_pivots(256) == 7
    assert ts.default_pivots(1, split=True) == 7
    assert int(order_key(jnp.float32(-jnp.inf))) == ts._LO


def test_search_impl_dispatch_and_the_sampler_on_the_kernel(monkeypatch):
    """SEARCH_IMPL: auto is jnp on CPU; "pallas" routes the sampler's searches (full and
    buffered) through the kernel (interpreted here), which keeps the jnp path's tokens."""
    from jaxinfer.batch import SamplingArrays
    from jaxinfer.sampling import SamplerNeeds, sample_rows

    assert sf.search_impl() == "jnp"
    monkeypatch.setattr(sf, "SEARCH_IMPL", "cuda")
    with pytest.raises(ValueError, match="SEARCH_IMPL"):
        sf.search_impl()
    S, V = 6, 1000
    rng = np.random.default_rng(11)
    logits = jnp.asarray(rng.standard_normal((S, V)) * 3, jnp.float32)
    sa = SamplingArrays.neutral(S)
    sa.temperature[:] = [1.0, 0.7, 1.0, 0.0, 1.3, 1.0]
    sa.top_k[:] = [0, 5, 200, 3, 0, 64]  # full search, buffered, full, greedy, top-p, buffered
    sa.top_p[:] = [0.9, 0.8, 0.95, 0.5, 0.3, 1.0]
    sa.seeds[:] = np.stack([np.arange(S), np.ones(S)], 1)
    args = (logits, SamplingArrays(*map(jnp.asarray, sa)), jnp.zeros((S + 1, V), jnp.int32))
    needs = SamplerNeeds.of(sa, V)
    assert needs.full_search and needs.top_k_search
    outs = {}
    for impl in ("jnp", "pallas"):
        monkeypatch.setattr(sf, "SEARCH_IMPL", impl)
        assert ("pallas_call" in str(jax.make_jaxpr(
            lambda *a: sample_rows(*a, needs=needs))(*args))) == (impl == "pallas")
        run = jax.jit(lambda *a: sample_rows(*a, needs=needs))  # fresh: traced per impl
        outs[impl] = np.asarray(run(*args)[0].tokens)
    np.testing.assert_array_equal(outs["pallas"], outs["jnp"])


_SDS = jax.ShapeDtypeStruct


@pytest.mark.parametrize("S, V, pivots, split", [
    (1, 128256, 3, False), (256, 128256, 7, False), (8, 4096, 15, False), (3, 1000, 7, False),
    (1, 131072, 7, True)])
def test_kernels_lower_for_cuda(S, V, pivots, split):
    rows = _SDS((S,), jnp.float32)
    tag = f"_split_p{pivots}_v{V}_first" if split else f"_p{pivots}_v{V}"
    text = lower_for_cuda(functools.partial(ts.kth_largest, pivots=pivots, split=split),
                          _SDS((S, V), jnp.float32), rows, _SDS((S,), jnp.int32))
    assert f"kth_search{tag}" in text
    for compact in (0, 2048) if not split else (0,):
        text = lower_for_cuda(functools.partial(ts.nucleus_cut, pivots=pivots, split=split,
                                                compact=compact),
                              _SDS((S, V), jnp.float32), rows, rows, _SDS((S,), jnp.int32), rows)
        assert f"nucleus_search{f'_c{compact}' if compact else ''}{tag}" in text


def _normal_rows(seed: int, S: int, V: int):
    """Rows of distinct normal values (the benchmark's scale) with random top-k / top-p and
    the sampler's floor as the bracket's start."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((S, V)) * rng.choice([1.0, 3.0, 8.0], S)[:, None]).astype(np.float32)
    k = np.where(rng.random(S) < 0.6, V, rng.integers(2, V + 1, S)).astype(np.int32)
    p = rng.choice([0.3, 0.6, 0.9, 0.95, 0.99], S).astype(np.float32)
    xs, top, kk, pp = _args(x, k, p)
    kth = jnp.where(kk < V, jax.jit(sf.kth_largest)(xs, top, kk), -jnp.inf)
    return x, (xs, top, kth, kk, pp), sf.nucleus_floor(top, kth, kk, pp)


GEO = {"block": 128, "unroll": 2, "segment": 512, "interpret": True}


@pytest.mark.parametrize("V", [4096, 4099])
def test_compaction_finishes_on_the_bracket_s_copy_with_the_full_passes_cut(V):
    """The compacting kernel copies the bracket once it holds <= capacity elements (stats:
    passes over the row, elements copied) and cuts where the full passes cut (same tokens as
    the float64 sort where top_p is not within float32 rounding of a prefix mass)."""
    S = 12
    x, args, lo = _normal_rows(V, S, V)
    full = np.asarray(ts.nucleus_cut(*args, lo=lo, pivots=7, split=False, compact=0, **GEO))
    seen_copy = 0
    for cap in (16, 256, 8192):
        cut, stats = ts.nucleus_cut(*args, lo=lo, compact=cap, return_stats=True, **GEO)
        cut, stats = np.asarray(cut), np.asarray(stats)
        assert (stats[:, 1] <= cap).all() and (stats[:, 0] <= sf.search_passes(7)).all()
        if cap == 8192:  # every bracket fits after the first pass
            assert (stats[:, 0] == 1).all() and (stats[:, 1] >= 0).all()
        seen_copy += int((stats[:, 1] >= 0).sum())
        for i in range(S):
            kept, gap = _np_kept(x[i], int(args[3][i]), float(args[4][i]))
            if gap < 1e-5:
                continue
            np.testing.assert_array_equal(x[i] >= cut[i], kept, err_msg=f"cap {cap} row {i}")
            np.testing.assert_array_equal(cut[i], full[i], err_msg=f"cap {cap} row {i}")
    assert seen_copy >= 2 * S


def test_compaction_at_exactly_the_capacity():
    """A bracket of exactly ``capacity`` elements is copied at that pass (the dump slot is
    slot ``capacity``); one element fewer of capacity keeps reading the row; same cut."""
    V, S = 4099, 6
    _, args, lo = _normal_rows(7, S, V)
    base, stats = ts.nucleus_cut(*args, lo=lo, compact=V, return_stats=True, **GEO)
    stats = np.asarray(stats)
    copied = [i for i in range(S) if stats[i, 1] > 1]  # rows whose bracket was copied
    assert len(copied) >= S // 2
    for i in copied[:3]:  # each capacity is its own compiled kernel (~3 s in interpret mode)
        one = [a[i:i + 1] for a in args]
        n = int(stats[i, 1])
        cut, st = ts.nucleus_cut(*one, lo=lo[i:i + 1], compact=n, return_stats=True, **GEO)
        assert np.asarray(st).tolist() == [[1, n]]
        np.testing.assert_array_equal(np.asarray(cut)[0], np.asarray(base)[i])
        cut, st = ts.nucleus_cut(*one, lo=lo[i:i + 1], compact=n - 1, return_stats=True,
                                 **GEO)
        assert int(np.asarray(st)[0, 0]) >= 2  # another pass over the row first
        assert int(np.asarray(st)[0, 1]) < n


def test_a_compacted_row_s_cut_does_not_depend_on_its_batch():
    """With compaction at different passes per row (capacity 32), each row alone gives the
    batch's cut bit for bit; the pivot count is 7 whatever the batch size."""
    V, S = 2051, 8
    _, args, lo = _normal_rows(11, S, V)
    cut, stats = ts.nucleus_cut(*args, lo=lo, compact=32, return_stats=True, **GEO)
    assert len(set(np.asarray(stats)[:, 0].tolist())) >= 2  # rows copy after different passes
    for i in range(S):
        one = ts.nucleus_cut(*(a[i:i + 1] for a in args), lo=lo[i:i + 1], compact=32, **GEO)
        np.testing.assert_array_equal(np.asarray(one)[0], np.asarray(cut)[i])
    assert ts.default_pivots(1, compact=32) == ts.default_pivots(256, compact=32) == 7
    with pytest.raises(ValueError, match="split mode"):
        ts.nucleus_cut(*args, compact=32, split=True, **GEO)
