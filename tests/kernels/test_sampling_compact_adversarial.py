"""Adversarial inputs for the compacting nucleus search (``threshold_search.nucleus_cut`` with
``compact`` > 0, Pallas interpret mode): heavy ties (the tie at the cut, a tie group larger
than the capacity), -inf, +0.0 / -0.0, huge magnitudes, one finite value in the masked tail,
V below one block, k = 1 / 2 / V, top_p 1 and tiny, the sampler's floor as the bracket start.
The compacting kernel must keep the float64 sort's tokens (where top_p is not within float32
rounding of a prefix mass), cut where the full passes cut, copy at most ``compact`` elements
and give a row's cut whatever its batch.

The last two tests pin a bug helper-38 found (fixed in ``search_steps.copy_bracket``): a
bracket whose top key is 0x7FFFFFFF (the key of -0.0, whose value is +0.0, as the key
0x80000000 above it) counted every zero twice once compacted — the copy tested
``x <= value(hi)`` while the mass above the bracket was measured as ``x >= value(hi + 1)``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import sampling_filters as sf
from jaxinfer.order_keys import key_value, order_key
from pallas_kernels.sampling import threshold_search as ts
from tests.kernels.cuda_lowering import lower_for_cuda
from tests.kernels.test_sampling_search import GEO, _np_kept

_SDS = jax.ShapeDtypeStruct
PASSES = sf.search_passes(7)


def _f32(bits: int) -> np.float32:
    return np.array([bits], np.uint32).view(np.float32)[0]


def _setup(x: np.ndarray, k, p):
    """Device args (x, top, kth, k, top_p) of rows ``x`` with top-k ``k`` (V: off, kth -inf)
    and top-p ``p``, and the sampler's bracket start (``sf.nucleus_floor``)."""
    V = x.shape[1]
    xs, top = jnp.asarray(x), jnp.asarray(x.max(-1))
    kk, pp = jnp.asarray(np.asarray(k, np.int32)), jnp.asarray(np.asarray(p, np.float32))
    kth = jnp.where(kk < V, jax.jit(sf.kth_largest)(xs, top, kk), -jnp.inf)
    return (xs, top, kth, kk, pp), sf.nucleus_floor(top, kth, kk, pp)


def _check_rows(x, args, cut, full=None, min_checked=1):
    """Each row not within 1e-5 of a prefix mass keeps the float64 sort's tokens (and the full
    passes' cut, bit for bit); no cut is -0.0."""
    cut = np.asarray(cut)
    assert not np.any((cut == 0) & np.signbit(cut))
    checked = 0
    for i in range(x.shape[0]):
        kept, gap = _np_kept(x[i], int(args[3][i]), float(args[4][i]))
        if gap < 1e-5:
            continue
        np.testing.assert_array_equal(x[i] >= cut[i], kept, err_msg=f"row {i}")
        if full is not None:
            np.testing.assert_array_equal(cut[i], full[i], err_msg=f"row {i}")
        checked += 1
    assert checked >= min_checked


def _adversarial_rows(V: int) -> tuple[np.ndarray, list, list]:
    """Eight hand-built rows of V (not a multiple of the 256-element step) and their k, top_p."""
    rng = np.random.default_rng(V)
    x = np.empty((8, V), np.float32)
    x[0] = rng.choice(np.float32([2.0, 0.0, -0.0, -1.0, -np.inf]), V)  # ties, the cut at 0
    x[1] = rng.choice(np.float32([1e30, -1e30, 0.0, -0.0, 1.0, -np.inf]), V)  # huge magnitudes
    x[2] = -np.inf  # nothing finite
    x[3] = -np.inf
    x[3, V - 1] = -3.5  # one finite value, in the masked tail's last step
    x[4] = (rng.standard_normal(V) * 3).round(0)  # integer ties, k = 2
    x[5] = rng.choice(np.float32([1.5, 1.5, -0.5, -7.0]), V)  # ties at the top, k = 1
    x[6] = rng.standard_normal(V) * 8  # top_p 1 with top-k: the k-th value
    x[7] = rng.standard_normal(V) * 0.1  # a flat-ish row, tiny top_p: the maximum
    x[[4, 6, 7], ::7] = -np.inf
    k = [V, V, V, 5, 2, 1, 37, V]
    p = [0.85, 0.9, 0.9, 0.7, 0.8, 0.5, 1.0, 1e-7]
    return x, k, p


@pytest.mark.parametrize("V", [300, 1000])
def test_adversarial_rows_at_every_capacity(V):
    """Capacities 1, 2, 7, 64 and V against the full passes (compact=0) and the float64 sort;
    stats: passes over the row within search_passes(7), at most ``compact`` copied."""
    x, k, p = _adversarial_rows(V)
    args, lo = _setup(x, k, p)
    full = np.asarray(ts.nucleus_cut(*args, lo=lo, pivots=7, split=False, compact=0, **GEO))
    kth = np.asarray(args[2])
    for cap in (1, 2, 7, 64, V) if V == 300 else (2, V):
        cut, stats = ts.nucleus_cut(*args, lo=lo, compact=cap, return_stats=True, **GEO)
        cut, stats = np.asarray(cut), np.asarray(stats)
        assert (stats[:, 1] <= cap).all() and (stats[:, 1] >= -1).all(), (cap, stats)
        assert (stats[:, 0] >= 0).all() and (stats[:, 0] <= PASSES).all(), (cap, stats)
        assert cut[2] == -np.inf and stats[2].tolist() == [0, -1]  # all -inf: no pass
        assert cut[3] == np.float32(-3.5)
        assert cut[5] == np.float32(1.5)  # k = 1 (kth = top): the bracket starts closed
        assert stats[5].tolist() == [0, -1]
        assert cut[6] == kth[6] and stats[6].tolist() == [0, -1]  # top_p 1: the k-th value
        assert cut[7] == x[7].max()  # tiny top_p: the best token alone
        _check_rows(x, args, cut, full, min_checked=6)


def test_a_tie_group_larger_than_the_capacity_never_copies():
    """The cut's value is held by 120 elements: a bracket around it never holds fewer, so with
    capacity 119 every pass reads the row (no copy) and with 120 the row is copied; same cut."""
    V = 700
    x = np.full((1, V), -4.0, np.float32)
    x[0, :120] = -1.25  # the tie at the cut
    x[0, 120:130] = 3.0
    x[0, 130:140] = np.float32(0.75)
    x[0, 600:] = -np.inf
    np.random.default_rng(0).shuffle(x[0])
    args, lo = _setup(x, [V], [0.92])
    kept, gap = _np_kept(x[0], V, 0.92)
    assert x[0][kept].min() == np.float32(-1.25) and gap > 1e-4
    cuts = {}
    for cap in (119, 120):
        cut, stats = ts.nucleus_cut(*args, lo=lo, compact=cap, return_stats=True, **GEO)
        cuts[cap] = float(np.asarray(cut)[0])
        copied = int(np.asarray(stats)[0, 1])
        assert copied == (-1 if cap == 119 else 120), (cap, np.asarray(stats))
    assert cuts[119] == cuts[120] == -1.25


def test_a_row_s_cut_is_the_same_alone_and_in_a_batch_at_small_capacity():
    """Capacity 2 (rows copy after different passes, or never): each row alone (S = 1) gives
    its cut in the batch bit for bit, and the stats too."""
    V = 300
    x, k, p = _adversarial_rows(V)
    args, lo = _setup(x, k, p)
    cut, stats = ts.nucleus_cut(*args, lo=lo, compact=2, return_stats=True, **GEO)
    for i in (0, 1, 4):
        one, st = ts.nucleus_cut(*(a[i:i + 1] for a in args), lo=lo[i:i + 1], compact=2,
                                 return_stats=True, **GEO)
        np.testing.assert_array_equal(np.asarray(one)[0], np.asarray(cut)[i])
        np.testing.assert_array_equal(np.asarray(st)[0], np.asarray(stats)[i])


def test_rows_shorter_than_a_block_and_the_floor_as_start():
    """V = 1 and V = 5 at the default geometry (block 1024: one masked step); the sampler's
    floor and kth as the bracket start give the same cut, the floor in no more passes."""
    x1 = np.float32([[0.5], [-np.inf], [-0.0]])
    a1, lo1 = _setup(x1, [1, 1, 1], [0.9, 0.9, 0.3])
    for cap in (1, 2):
        cut = np.asarray(ts.nucleus_cut(*a1, lo=lo1, compact=cap, interpret=True))
        np.testing.assert_array_equal(cut, np.float32([0.5, -np.inf, 0.0]))
        assert not np.signbit(cut[2])  # -0.0 comes back as +0.0
    x = np.float32([[3.0, -1.0, 3.0, 2.5, -np.inf], [0.0, -0.0, -5.0, -0.0, -6.0],
                    [1e30, -1e30, 0.0, 1.0, -np.inf], [-2.0, -2.0, -2.0, -2.0, -2.0]])
    args, lo = _setup(x, [5, 3, 5, 5], [0.8, 0.5, 0.3, 0.5])
    assert float(lo[0]) > float(args[2][0])  # the floor is above kth on row 0
    res = {}
    for name, start in (("floor", lo), ("kth", None)):
        cut, stats = ts.nucleus_cut(*args, lo=start, compact=2, return_stats=True,
                                    interpret=True)
        res[name] = (np.asarray(cut), np.asarray(stats))
        assert (res[name][1][:, 1] <= 2).all()
        _check_rows(x, args, cut, min_checked=4)
    np.testing.assert_array_equal(res["floor"][0], res["kth"][0])
    assert (res["floor"][1][:, 0] <= res["kth"][1][:, 0]).all()
    np.testing.assert_array_equal(res["kth"][0], np.float32([2.5, 0.0, 1e30, -2.0]))


@pytest.mark.parametrize("S, V, compact, kw", [
    (1, 1, 1, {}), (3, 100, 1, {}), (2, 4099, 4099, {}), (1, 5, 2, {"pivots": 3}),
    (2, 300, 64, {"block": 128, "unroll": 2, "segment": 512})])
def test_odd_shapes_lower_for_cuda(S, V, compact, kw):
    rows = _SDS((S,), jnp.float32)

    def fn(x, top, kth, k, p, lo):
        return ts.nucleus_cut(x, top, kth, k, p, lo=lo, compact=compact, return_stats=True,
                              **kw)

    text = lower_for_cuda(fn, _SDS((S, V), jnp.float32), rows, rows, _SDS((S,), jnp.int32),
                          rows, rows)
    assert f"nucleus_search_c{compact}_p{kw.get('pivots', 7)}_v{V}" in text


# The bug (fixed: copy_bracket now copies x >= value(lo) and not x >= value(hi + 1), the sweeps'
# own predicates). narrow_tracked (search_steps) records count(x > hi) and mass(x > hi) as the
# measures of the smallest failing pivot hi + 1, i.e. of x >= key_value(hi + 1); copy_bracket
# copied lo <= x <= key_value(hi). These are complements only while key_value(hi) < key_value(hi +
# 1). At hi = 0x7FFFFFFF (the key of -0.0) both values are 0: every +-0 element is in mass_hi AND
# in the copy (masses counted twice: the cut comes out too high, tokens dropped) and not in the
# tracked population (the copy can exceed ``compact``: on a GPU the stores run past the row's
# [compact + 1] scratch into the next row's). Reached when the smallest failing pivot of a pass
# over the row is exactly 0x80000000 and the one below passes: negative values of magnitude below
# ~1e-19 (P = 7) carry the mass between them. Here lo = order_key(-T) = 0x7FFFFFFF - b, hi =
# order_key(T) = 0x80000000 + b with b = bits(T) = 3 (mod 4): the 4th pivot of the first pass is
# 0x80000000. (On a backend that flushes subnormals, XLA:CPU / the interpreter, the same for any
# failing pivot whose value is a positive subnormal: T = 3.0 fails too there.)
_T = _f32(0x40400003)  # 3.0000007
_ZERO_ROW = np.float32([[_T] + [0.0] * 20 + [-1e-30] * 20 + [-_T] * 2])  # V = 43
_ZERO_ARGS = functools.partial(_setup, _ZERO_ROW, [42], [0.8])  # kth = -T, the cut -1e-30


def test_the_zero_row_s_setting():
    """What the two tests below rely on: kth = -T, the first pass's 4th pivot is key
    0x80000000 (value 0), the float64 sort, the jnp search and the full passes all cut at
    -1e-30, and so does the compacting kernel while it never copies (capacity 19)."""
    args, lo = _ZERO_ARGS()
    assert float(args[2][0]) == -_T and float(lo[0]) == -_T  # the sampler starts at kth
    piv = ts.pivot_keys(order_key(args[2])[0], order_key(args[1])[0], 7)
    assert int(piv[3]) == 0x80000000 and float(key_value(piv[2])) < -1e-30
    kept, gap = _np_kept(_ZERO_ROW[0], 42, 0.8)
    assert gap > 1e-4 and _ZERO_ROW[0][kept].min() == np.float32(-1e-30) and kept.sum() == 41
    assert float(jax.jit(sf.nucleus_cut)(*args)[0]) == np.float32(-1e-30)
    full = np.asarray(ts.nucleus_cut(*args, pivots=7, split=False, compact=0, **GEO))
    cut, stats = ts.nucleus_cut(*args, compact=19, return_stats=True, **GEO)
    assert full[0] == np.asarray(cut)[0] == np.float32(-1e-30)
    assert int(np.asarray(stats)[0, 1]) == -1


def test_zeros_at_the_bracket_s_top_key_are_counted_once():
    args, _ = _ZERO_ARGS()
    cut = np.asarray(ts.nucleus_cut(*args, compact=40, **GEO))  # room for the whole copy
    assert cut[0] == np.float32(-1e-30)  # was 0.0: the 20 tokens at -1e-30 dropped


def test_the_copy_never_exceeds_the_capacity_with_zeros_at_the_bracket_s_top():
    args, _ = _ZERO_ARGS()
    _, stats = ts.nucleus_cut(*args, compact=20, return_stats=True, **GEO)
    assert int(np.asarray(stats)[0, 1]) <= 20  # was 40: slots 21..39 written past the dump


def test_a_subnormal_failing_pivot_on_a_flushing_backend():
    """T = 3.0: the failing pivot's value is a positive subnormal, which the interpreter
    (XLA:CPU) compares as 0: the zeros were counted twice there too; now the cut is the full
    passes' and at most 20 elements are copied."""
    row = np.float32([[3.0] + [0.0] * 20 + [-1e-30] * 20 + [-3.0] * 2])
    args, _ = _setup(row, [42], [0.8])
    full = np.asarray(ts.nucleus_cut(*args, pivots=7, split=False, compact=0, **GEO))
    cut, stats = ts.nucleus_cut(*args, compact=20, return_stats=True, **GEO)
    assert np.asarray(cut)[0] == full[0] == np.float32(-1e-30)
    assert 0 <= int(np.asarray(stats)[0, 1]) <= 20
