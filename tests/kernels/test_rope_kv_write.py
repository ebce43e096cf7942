"""RoPE + KV write in one Pallas kernel (``rope_kv_write.rope_write_kv_pallas``, interpret mode):
q, and the pages it writes, equal ``apply_rope`` on q and k followed by
``reference.write_kv_ref`` (bf16 / FP8 / f32 pools, GQA with a query-head count that is not a
power of two, padding tokens, poisoned caches); bad input gets a clear error; it lowers for an
H200 with the caches aliased."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.layers.norm import rms_norm
from jaxinfer.layers.rope import apply_rope, inv_frequencies, rope_cos_sin
from pallas_kernels.paged_attention import reference as ref
from pallas_kernels.paged_attention.rope_kv_write import (
    rope_kv_write_supported,
    rope_write_kv_pallas,
)

E4M3 = jnp.float8_e4m3fn


def _inputs(rng, T, Hq, Hkv, D, P, ps, dtype, padding=0):
    qkv = (rng.standard_normal((T, (Hq + 2 * Hkv) * D)) * 3).astype(np.float32)
    if dtype == E4M3:
        qkv[0, Hq * D] = 3000.0  # a K value past e4m3's range after / 2: saturates
    pos = rng.integers(0, 5000, T).astype(np.int32)
    cos, sin = rope_cos_sin(jnp.asarray(pos), jnp.asarray(inv_frequencies(D, 500000.0, None)))
    slots = rng.permutation(np.arange(ps, P * ps))[:T].astype(np.int32)
    if padding:
        slots[-padding:] = 0
    return jnp.asarray(qkv, jnp.bfloat16), cos, sin, jnp.asarray(slots)


def _order(x: np.ndarray) -> np.ndarray:
    """Each float's rank among its dtype's values (sign-magnitude bits made monotone)."""
    bits = 8 * x.dtype.itemsize
    u = x.view({8: np.uint8, 16: np.uint16, 32: np.uint32}[bits]).astype(np.int64)
    mag = u & ((1 << (bits - 1)) - 1)
    return np.where(u >> (bits - 1), -mag, mag)


def _assert_one_step(got: jax.Array, want: jax.Array, max_frac: float = 0.02):
    """Every value equals the reference's or its neighbour in the dtype (the kernel's float32
    rotation may contract to an FMA where XLA's does not, or the reverse: a last-bit rounding
    difference, then one step of an FP8 pool), and at most ``max_frac`` of them differ."""
    g, w = np.asarray(got), np.asarray(want)
    steps = np.abs(_order(g) - _order(w))
    assert steps.max() <= 1, (
        f"{int((steps > 1).sum())} values off by more than one step; worst "
        f"{g.astype(np.float32).ravel()[steps.argmax()]} vs "
        f"{w.astype(np.float32).ravel()[steps.argmax()]}")
    assert (steps > 0).mean() <= max_frac, f"{(steps > 0).mean():.3%} of the values differ"


def _reference(kc, vc, layer, qkv, cos, sin, slots, Hq, ks, vs, bias=None, norms=None,
               eps=1e-6):
    """The engine's XLA path (AttentionBackend.attend_qkv's order): split, + bias, per-head
    rms_norm of q and k, apply_rope, write_kv_ref."""
    T, D = qkv.shape[0], kc.shape[-1]
    Hkv = kc.shape[1]
    q, k, v = jnp.split(qkv, [Hq * D, (Hq + Hkv) * D], -1)
    if bias is not None:
        q, k, v = q + bias[0], k + bias[1], v + bias[2]
    q, k, v = q.reshape(T, Hq, D), k.reshape(T, Hkv, D), v.reshape(T, Hkv, D)
    if norms is not None:
        q, k = rms_norm(q, norms[0], eps), rms_norm(k, norms[1], eps)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    kc, vc = ref.write_kv_ref(kc, vc, layer, k, v, slots, k_scale=ks, v_scale=vs,
                              method="rows")
    return q, kc, vc


def _extras(rng, Hq, Hkv, D, extra):
    """(bias, norms) of a test case: Qwen2's bias, Qwen3 / Gemma 3's q / k norm, both."""
    bf = jnp.bfloat16
    bias = norms = None
    if extra in ("bias", "both"):
        bias = tuple(jnp.asarray(rng.standard_normal(n * D), bf) for n in (Hq, Hkv, Hkv))
    if extra in ("norm", "both"):
        norms = tuple(jnp.asarray(1 + 0.3 * rng.standard_normal(D), bf) for _ in range(2))
    return bias, norms


@pytest.mark.parametrize("dtype", [jnp.bfloat16, E4M3, jnp.float32])
@pytest.mark.parametrize("T,Hq,Hkv,D", [(1, 4, 2, 32), (5, 3, 1, 64), (9, 8, 2, 32)])
@pytest.mark.parametrize("extra", ["none", "bias", "norm", "both"])
def test_equals_the_xla_path(dtype, T, Hq, Hkv, D, extra):
    L, P, ps = 3, 12, 4
    rng = np.random.default_rng(T * 100 + Hq)
    qkv, cos, sin, slots = _inputs(rng, T, Hq, Hkv, D, P, ps, dtype,
                                   padding=min(2, T - 1))
    bias, norms = _extras(rng, Hq, Hkv, D, extra)
    if norms is not None and dtype == E4M3:  # normed K is O(1): make the saturation visible
        norms = (norms[0], norms[1] * 2000)
    kc = jnp.full((L, Hkv, P, ps, D), -7, dtype)  # poisoned: values no write produces
    vc = jnp.full((L, Hkv, P, ps, D), 5, dtype)
    ks, vs = (jnp.float32(2.0), jnp.float32(0.25)) if dtype == E4M3 else (None, None)
    layer = 1
    got = jax.jit(lambda kc, vc, lay, *a: rope_write_kv_pallas(
        kc, vc, lay, *a, num_heads=Hq, k_scale=ks, v_scale=vs, bias=bias,
        q_norm=None if norms is None else norms[0],
        k_norm=None if norms is None else norms[1], eps=1e-5, interpret=True))(
        kc, vc, jnp.int32(layer), qkv, cos, sin, slots)
    want = _reference(kc, vc, layer, qkv, cos, sin, slots, Hq, ks, vs, bias, norms, 1e-5)
    f32 = np.float32
    assert got[0].shape == (T, Hq, D) and got[0].dtype == qkv.dtype
    _assert_one_step(got[0], want[0])
    for g, w in zip(got[1:], want[1:]):  # outside the null page, where padding writes
        assert g.dtype == dtype
        _assert_one_step(g[:, :, 1:], w[:, :, 1:])
    # V is stored (+ bias), not computed: exactly the reference's
    np.testing.assert_array_equal(np.asarray(got[2]).astype(f32)[:, :, 1:],
                                  np.asarray(want[2]).astype(f32)[:, :, 1:])
    others = [x for x in range(L) if x != layer]
    assert np.all(np.asarray(got[1])[others].astype(f32) == -7)
    assert np.all(np.asarray(got[2])[others].astype(f32) == 5)
    s = int(slots[0])
    raw_k = np.asarray(qkv[0, Hq * D:(Hq + 1) * D]).astype(f32)
    if dtype == jnp.float32:  # the rotation (and bias / norm) happened: not the raw k
        assert not np.allclose(np.asarray(got[1])[layer, 0, s // ps, s % ps], raw_k)
    if dtype == E4M3:  # a K value far past 448 * 2: saturated
        row = np.asarray(got[1])[layer, 0, s // ps, s % ps].astype(f32)
        assert np.abs(row).max() == 448.0


def test_refuses_bad_input():
    kc = jnp.zeros((2, 2, 3, 4, 32), jnp.bfloat16)
    qkv = jnp.zeros((3, (4 + 4) * 32), jnp.bfloat16)
    cs = jnp.zeros((3, 32), jnp.float32)
    s = jnp.zeros(3, jnp.int32)

    def call(kc=kc, vc=kc, layer=0, qkv=qkv, cos=cs, slots=s, heads=4):
        return rope_write_kv_pallas(kc, vc, layer, qkv, cos, cs, slots, heads, interpret=True)

    with pytest.raises(ValueError, match=r"qkv must be \[T, 224\] \(3 query \+ 2 x 2 KV"):
        call(heads=3)
    with pytest.raises(ValueError, match=r"qkv must be \[T, 256\]"):
        call(qkv=qkv[:, :-32])
    with pytest.raises(ValueError, match="caches differ"):
        call(vc=kc.astype(jnp.float32))
    with pytest.raises(ValueError, match=r"cos / sin must be \[3, 32\]"):
        call(cos=cs[:, :16])
    with pytest.raises(ValueError, match="1-D integer array of 3 slots"):
        call(slots=s[:2])
    with pytest.raises(ValueError, match="1-D integer array of 3 slots"):
        call(slots=s.astype(jnp.float32))
    with pytest.raises(ValueError, match="layer 2 is outside the cache's 2 layers"):
        call(layer=2)
    with pytest.raises(ValueError, match=r"\[L, Hkv, P, ps, D\]"):
        call(kc=kc[0], vc=kc[0])
    kc16 = jnp.zeros((2, 2, 3, 4, 16), jnp.bfloat16)
    with pytest.raises(ValueError, match="head dim 16"):
        rope_write_kv_pallas(kc16, kc16, 0, qkv[:, :128], cs[:, :16], cs[:, :16], s, 4,
                             interpret=True)
    w32, b = jnp.ones(32, jnp.bfloat16), jnp.zeros(64, jnp.bfloat16)
    with pytest.raises(ValueError, match=r"q_norm and k_norm must both be \[32\]"):
        rope_write_kv_pallas(kc, kc, 0, qkv, cs, cs, s, 4, q_norm=w32, interpret=True)
    with pytest.raises(ValueError, match=r"q_norm and k_norm must both be \[32\]"):
        rope_write_kv_pallas(kc, kc, 0, qkv, cs, cs, s, 4, q_norm=w32, k_norm=w32[:16],
                             interpret=True)
    with pytest.raises(ValueError, match=r"bias must be \(bq \[128\], bk \[64\], bv \[64\]\)"):
        rope_write_kv_pallas(kc, kc, 0, qkv, cs, cs, s, 4, bias=(b, b, b), interpret=True)
    from pallas_kernels.matmul.triton_gemm import SplitKPartials

    parts = jnp.zeros((2, 3, 256), jnp.float32)
    for bad, msg in ((SplitKPartials(parts, jnp.ones(1), None), r"x_scale must be \[3\]"),
                     (SplitKPartials(parts, None, jnp.ones(255)), r"w_scale must be \[256\]"),
                     (SplitKPartials(parts.astype(jnp.bfloat16), None, None), "float32")):
        with pytest.raises(ValueError, match=msg):
            rope_write_kv_pallas(kc, kc, 0, bad, cs, cs, s, 4, interpret=True)
    assert [rope_kv_write_supported(d) for d in (16, 32, 64, 96, 128, 256)] == [
        False, True, True, False, True, True]
    q, k, v = rope_write_kv_pallas(kc, kc, 0, qkv[:0], cs[:0], cs[:0], s[:0], 4,
                                   interpret=True)
    assert q.shape == (0, 4, 32) and k is kc and v is kc


@pytest.mark.parametrize("dtype,scales", [(jnp.bfloat16, False), (E4M3, True)])
@pytest.mark.parametrize("T,Hq,Hkv,D", [(1, 32, 8, 128), (64, 32, 8, 128), (8, 9, 3, 64)])
def test_lowers_for_an_h200(dtype, scales, T, Hq, Hkv, D):
    """Engine shapes (8B at 1 / 64 tokens, SmolLM2's 9 / 3 heads) over a pool past 2^32
    bytes, the caches aliased to the outputs."""
    from tests.kernels.cuda_lowering import lower_for_cuda

    sds = jax.ShapeDtypeStruct
    pool = sds((32, Hkv, 36000 * 8 // Hkv, 16, D), dtype)
    args = [pool, pool, sds((), jnp.int32), sds((T, (Hq + 2 * Hkv) * D), jnp.bfloat16),
            sds((T, D), jnp.float32), sds((T, D), jnp.float32), sds((T,), jnp.int32)]
    args += [sds((), jnp.float32)] * 2 if scales else []

    def fn(kc, vc, layer, qkv, cos, sin, slots, *scales):
        return rope_write_kv_pallas(kc, vc, layer, qkv, cos, sin, slots, Hq, *scales)

    text = lower_for_cuda(fn, *args)
    assert "rope_kv_write" in text and "__gpu$xla.gpu.triton" in text
    assert "output_operand_aliases" in text


def test_check_script_cpu_smoke_checks_and_fails_on_a_wrong_kernel(tmp_path, monkeypatch):
    """benchmarks/kernels/check_rope_kv_write.py (the device check) passes on the kernel in
    interpret mode, records every point, and exits 1 when the kernel's output is wrong."""
    import json

    from benchmarks.kernels import check_rope_kv_write as chk

    assert chk.main(["--cpu-smoke", "--out", str(tmp_path)]) == 0
    recs = json.loads((tmp_path / "rope_kv_write.json").read_text())
    assert {r["config"]["extra"] for r in recs} == {"norm", "none", "split2"}
    assert all(r["config"]["check"] == "ok" for r in recs)
    real = chk.rope_write_kv_pallas

    def q_off(q, kc, vc):  # q one step off everywhere
        return q * 1.02, kc, vc

    def k_off(q, kc, vc):  # every stored K value doubled (the written rows too)
        return q, (kc.astype(jnp.float32) * 2).astype(kc.dtype), vc

    def stray(q, kc, vc):  # one write outside the slots (layer 0, page 1, first row)
        return q, kc, vc.at[0, :, 1, 0].set(jnp.asarray(7.0, vc.dtype))

    for wrong in (q_off, k_off, stray):
        monkeypatch.setattr(chk, "rope_write_kv_pallas",
                            lambda *a, wrong=wrong, **k: wrong(*real(*a, **k)))
        assert chk.main(["--cpu-smoke", "--out", str(tmp_path)]) == 1, wrong.__name__


@pytest.mark.parametrize("splits,scaled", [(2, True), (4, True), (3, False)])
@pytest.mark.parametrize("extra", ["none", "both"])
def test_takes_split_k_partials(splits, scaled, extra):
    """qkv as a split-K GEMM's unreduced partials (triton_gemm.SplitKPartials): the kernel
    sums them in the epilogue's order and gives what it gives on the reduced output."""
    from pallas_kernels.matmul.triton_gemm import SplitKPartials

    T, Hq, Hkv, D, L, P, ps = 5, 4, 2, 32, 2, 12, 4
    rng = np.random.default_rng(splits)
    W = (Hq + 2 * Hkv) * D
    parts = SplitKPartials(
        jnp.asarray(rng.standard_normal((splits, T, W)), jnp.float32),
        jnp.asarray(rng.uniform(0.5, 2, T), jnp.float32) if scaled else None,
        jnp.asarray(rng.uniform(0.5, 2, W), jnp.float32) if scaled else None, jnp.bfloat16)
    _, cos, sin, slots = _inputs(rng, T, Hq, Hkv, D, P, ps, E4M3, padding=1)
    bias, norms = _extras(rng, Hq, Hkv, D, extra)
    kc = jnp.zeros((L, Hkv, P, ps, D), E4M3)
    kw = dict(k_scale=jnp.float32(0.5), v_scale=jnp.float32(0.25), bias=bias,
              q_norm=None if norms is None else norms[0],
              k_norm=None if norms is None else norms[1], interpret=True)
    got = rope_write_kv_pallas(kc, kc, 1, parts, cos, sin, slots, Hq, **kw)
    want = rope_write_kv_pallas(kc, kc, 1, parts.reduce(), cos, sin, slots, Hq, **kw)
    assert got[0].dtype == jnp.bfloat16
    for g, w in zip(got, want):
        _assert_one_step(g, w)
    ref_q = _reference(kc, kc, 1, parts.reduce(), cos, sin, slots, Hq, kw["k_scale"],
                       kw["v_scale"], bias, norms)[0]
    _assert_one_step(got[0], ref_q)
