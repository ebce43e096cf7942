"""row_quant.norm_quant_fp8 (RMSNorm + per-token FP8 quantization in one Pallas kernel) in
interpret mode against the unfused math on fresh random inputs, its errors, its lowering for
an H200, and the engine's decode program using it at every FP8 projection."""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.layers.norm import rms_norm
from pallas_kernels.matmul import quantize_rows_fp8
from pallas_kernels.matmul.reference import silu_mul_ref
from pallas_kernels.matmul.row_quant import norm_quant_fp8, row_quant_supported
from tests.kernels.cuda_lowering import lower_for_cuda

F32 = jnp.float32


def _inputs(seed: int, M: int, K: int, dtype):
    kx, kw = jax.random.split(jax.random.PRNGKey(seed))
    # rows of different magnitudes, one all-zero row (the MIN_ABSMAX floor)
    mag = jnp.exp(jax.random.uniform(kx, (M, 1), F32, -3.0, 3.0))
    x = (jax.random.normal(kx, (M, K), F32) * mag).astype(dtype)
    x = x.at[M // 2].set(0)
    w = jax.random.normal(kw, (K,), F32) + 1.0
    return x, w


@pytest.mark.parametrize("dtype", [jnp.bfloat16, F32])
@pytest.mark.parametrize("M,K", [(1, 64), (5, 256), (2, 576), (64, 4096), (3, 8192),
                                 (2, 14336)])
@pytest.mark.parametrize("norm", [True, False])
def test_equals_the_unfused_math(dtype, M, K, norm):
    x, w = _inputs(M * K, M, K, dtype)
    q, s = norm_quant_fp8(x, w if norm else None, 1e-5, interpret=True)
    # the normed row in float32 up to the quantization, as XLA compiles the unfused path
    h = rms_norm(x.astype(F32), w, 1e-5) if norm else x
    want_q, want_s = quantize_rows_fp8(h)
    assert q.dtype == jnp.float8_e4m3fn and q.shape == (M, K) and s.shape == (M,)
    got_q, want_q = np.asarray(q.astype(F32)), np.asarray(want_q.astype(F32))
    if not norm:
        np.testing.assert_array_equal(np.asarray(s), np.asarray(want_s))
        np.testing.assert_array_equal(got_q, want_q)
    else:
        # the normed float32 row keeps the mean-square's summation order (the kernel's chunks
        # vs XLA's) in its last bits: scales within a few ulp, an element at an e4m3
        # rounding boundary may land one step away
        np.testing.assert_allclose(np.asarray(s), np.asarray(want_s), rtol=1e-6, atol=0)
        diff = got_q != want_q
        assert diff.mean() < 1e-3
        np.testing.assert_allclose(got_q[diff], want_q[diff], rtol=2 ** -3)
    # and it is a quantization of the row: q * scale reproduces it to e4m3's resolution
    h = np.asarray(h.astype(F32))
    back = np.asarray(q.astype(F32)) * np.asarray(s)[:, None]
    np.testing.assert_allclose(back, h, rtol=2 ** -3, atol=float(np.asarray(s).max()) * 2 ** -6)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, F32])
@pytest.mark.parametrize("M,K", [(1, 64), (5, 576), (4, 4096), (2, 14336)])
@pytest.mark.parametrize("norm", [True, False])
def test_residual_add_fused_in_front(dtype, M, K, norm):
    """residual=: h = x + residual rounded to x's dtype (XLA's add of the two) comes back
    bit-exact, and q / scale are bit-identical to the kernel's on that h (the unfused pair:
    XLA add, then this kernel)."""
    x, w = _inputs(M * K + 1, M, K, dtype)
    d = jax.random.normal(jax.random.PRNGKey(M * K + 2), (M, K), F32).astype(dtype)
    q, s, h = norm_quant_fp8(x, w if norm else None, 1e-5, residual=d, interpret=True)
    want_h = x + d  # XLA's add in x's dtype
    assert h.dtype == x.dtype and h.shape == (M, K)
    np.testing.assert_array_equal(np.asarray(h.astype(F32)), np.asarray(want_h.astype(F32)))
    want_q, want_s = norm_quant_fp8(want_h, w if norm else None, 1e-5, interpret=True)
    np.testing.assert_array_equal(np.asarray(s), np.asarray(want_s))
    np.testing.assert_array_equal(np.asarray(q.astype(F32)), np.asarray(want_q.astype(F32)))
    # the sum matters: without it the scales differ (the test can tell the paths apart)
    assert not np.array_equal(np.asarray(s), np.asarray(norm_quant_fp8(
        x, w if norm else None, 1e-5, interpret=True)[1]))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, F32])
@pytest.mark.parametrize("M,K,S", [(1, 64, 2), (5, 576, 4), (4, 4096, 4), (2, 14336, 3)])
@pytest.mark.parametrize("scaled", [True, False])
def test_split_k_residual_summed_in_front(dtype, M, K, S, scaled):
    """residual= a split-K GEMM's unreduced output (triton_gemm.SplitKPartials: the o / down
    projection's partials): the kernel runs the GEMM's epilogue (sum, x_scale, w_scale, cast
    to x's dtype) before the add, and gives what it gives on the reduced output, h included
    (interpret mode: the same float32 sums in the same order)."""
    from pallas_kernels.matmul.triton_gemm import SplitKPartials

    x, w = _inputs(M * K + 3, M, K, dtype)
    keys = jax.random.split(jax.random.PRNGKey(M + K + S), 3)
    parts = SplitKPartials(
        jax.random.normal(keys[0], (S, M, K), F32),
        jax.random.uniform(keys[1], (M,), F32, 0.5, 2.0) if scaled else None,
        jax.random.uniform(keys[2], (K,), F32, 0.5, 2.0) if scaled else None, dtype)
    got = norm_quant_fp8(x, w, 1e-5, residual=parts, interpret=True)
    # the epilogue with the partials summed in order (the kernel's; XLA's jnp.sum may pair
    # them differently: float32 sums one ulp apart, below a bf16 rounding but not an f32 one)
    acc = functools.reduce(jnp.add, list(parts.partials))
    acc = acc if not scaled else acc * parts.x_scale[:, None] * parts.w_scale[None, :]
    want = norm_quant_fp8(x, w, 1e-5, residual=acc.astype(dtype), interpret=True)
    for i, (g, r) in enumerate(zip(got, want)):  # q, scale, h
        assert g.dtype == r.dtype and g.shape == r.shape
        g, r = np.asarray(g.astype(F32)), np.asarray(r.astype(F32))
        if dtype == jnp.bfloat16:  # the cast to bf16 before the add: bit-exact
            np.testing.assert_array_equal(g, r)
        elif i == 0:  # float32 all the way: the CPU contracts the add into an FMA or not,
            # h and the scales move by an ulp, a quantized value rarely by an e4m3 step
            np.testing.assert_allclose(g, r, rtol=0.13)
            assert (g != r).mean() <= 0.01
        else:  # (cancellation in x + delta: an ulp of the addends, not of the sum)
            np.testing.assert_allclose(g, r, rtol=1e-6, atol=1e-6 * np.abs(r).max())
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(norm_quant_fp8(
        x, w, 1e-5, residual=parts.reduce(), interpret=True)[1]), rtol=1e-6)
    # the partials matter: a different split's sum gives other scales
    other = SplitKPartials(parts.partials[:1], parts.x_scale, parts.w_scale, dtype)
    assert not np.array_equal(np.asarray(got[1]), np.asarray(norm_quant_fp8(
        x, w, 1e-5, residual=other, interpret=True)[1]))
    with pytest.raises(ValueError, match="residual must be"):
        norm_quant_fp8(x.astype(F32 if dtype != F32 else jnp.bfloat16), w, residual=parts,
                       interpret=True)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, F32])
@pytest.mark.parametrize("M,F", [(2, 64), (5, 576), (3, 1536), (17, 4096), (2, 14336)])
def test_swiglu_fused_in_front(dtype, M, F):
    """swiglu=True (row M // 2 all zero, the others nonzero): [M, 2F] gate | up rows -> q /
    scale of silu(gate) * up (float32, rounded to x's dtype: reference.silu_mul_ref), as the
    unfused pair (XLA's SwiGLU, then this kernel's plain quantization) gives them."""
    x, _ = _inputs(M * F + 3, M, 2 * F, dtype)
    q, s = norm_quant_fp8(x, swiglu=True, interpret=True)
    act = silu_mul_ref(x)
    assert q.dtype == jnp.float8_e4m3fn and q.shape == (M, F) and s.shape == (M,)
    want_q, want_s = quantize_rows_fp8(act.astype(F32))
    # the kernel's sigmoid and XLA's logistic may differ in a float32 ulp: scales within
    # a few ulp, an element at an e4m3 rounding boundary one step away
    np.testing.assert_allclose(np.asarray(s), np.asarray(want_s), rtol=1e-6, atol=0)
    got_q, want_q = np.asarray(q.astype(F32)), np.asarray(want_q.astype(F32))
    diff = got_q != want_q
    assert diff.mean() < 1e-3
    np.testing.assert_allclose(got_q[diff], want_q[diff], rtol=2 ** -3)
    # the activation matters: quantizing the gate half alone gives other numbers
    assert not np.allclose(np.asarray(s), np.asarray(quantize_rows_fp8(
        x[:, :F].astype(F32))[1]))


@pytest.mark.parametrize("num_warps,one_pass", [(1, False), (8, False), (4, True),
                                                (16, True)])
@pytest.mark.parametrize("K", [1152, 14336])
def test_warps_and_passes_do_not_change_the_result(num_warps, one_pass, K):
    """Bit-identical results by num_warps and one_pass (the row held in registers), at every
    site's form: norm, plain, residual, swiglu."""
    x, w = _inputs(7, 3, K, jnp.bfloat16)
    d = jax.random.normal(jax.random.PRNGKey(8), x.shape, F32).astype(x.dtype)
    for kw in (dict(weight=w), dict(), dict(weight=w, residual=d), dict(swiglu=True)):
        want = norm_quant_fp8(x, **kw, one_pass=False, interpret=True)
        got = norm_quant_fp8(x, **kw, num_warps=num_warps, one_pass=one_pass,
                             interpret=True)
        for g, r in zip(got, want):
            np.testing.assert_array_equal(np.asarray(g.astype(F32)), np.asarray(r.astype(F32)))


@pytest.mark.parametrize("K,ok", [(32, False), (64, True), (576, True), (640, True),
                                  (4096, True), (14336, True), (16384, True), (1088, False),
                                  (100, False), (32768, False)])
def test_supported_widths(K, ok):
    assert row_quant_supported(K) is ok


def test_bad_input_is_refused():
    x = jnp.ones((2, 100), jnp.bfloat16)
    with pytest.raises(ValueError, match="K=100"):
        norm_quant_fp8(x, interpret=True)
    with pytest.raises(ValueError, match="weight must be"):
        norm_quant_fp8(jnp.ones((2, 64)), jnp.ones((32,)), interpret=True)
    with pytest.raises(ValueError, match=r"\[M, K\]"):
        norm_quant_fp8(jnp.ones((64,)), interpret=True)
    with pytest.raises(ValueError, match="residual must be"):
        norm_quant_fp8(jnp.ones((2, 64)), residual=jnp.ones((2, 64), jnp.bfloat16),
                       interpret=True)
    with pytest.raises(ValueError, match="residual must be"):
        norm_quant_fp8(jnp.ones((2, 64)), residual=jnp.ones((1, 64)), interpret=True)
    from pallas_kernels.matmul.triton_gemm import SplitKPartials

    p = jnp.zeros((3, 2, 64), F32)
    with pytest.raises(ValueError, match=r"norm_quant_fp8: split-K x_scale must be \[2\]"):
        norm_quant_fp8(jnp.ones((2, 64)), residual=SplitKPartials(p, jnp.ones(1), None, F32),
                       interpret=True)
    with pytest.raises(ValueError, match="residual must be"):
        norm_quant_fp8(jnp.ones((2, 64)), residual=SplitKPartials(p, None, None),
                       interpret=True)  # out_dtype bf16 vs x f32
    with pytest.raises(ValueError, match="swiglu takes"):
        norm_quant_fp8(jnp.ones((2, 129)), swiglu=True, interpret=True)
    with pytest.raises(ValueError, match="swiglu takes"):
        norm_quant_fp8(jnp.ones((2, 128)), jnp.ones((64,)), swiglu=True, interpret=True)
    with pytest.raises(ValueError, match="K=50"):
        norm_quant_fp8(jnp.ones((2, 100)), swiglu=True, interpret=True)


@pytest.mark.parametrize("M,K", [(1, 4096), (64, 4096), (16, 8192), (1, 14336), (4, 576)])
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("residual", [False, True])
def test_lowers_for_an_h200(M, K, norm, residual):
    sds = jax.ShapeDtypeStruct
    x = sds((M, K), jnp.bfloat16)
    args = (x,) + ((x,) if residual else ()) + ((sds((K,), F32),) if norm else ())

    def call(x, *rest):
        d, w = (rest[0], rest[1:]) if residual else (None, rest)
        return norm_quant_fp8(x, *w, eps=1e-5, residual=d)

    text = lower_for_cuda(call, *args)
    assert "norm_quant_fp8" in text and "__gpu$xla.gpu.triton" in text


@pytest.mark.parametrize("M,F", [(32, 14336), (64, 1536)])
def test_swiglu_lowers_for_an_h200(M, F):
    text = lower_for_cuda(lambda x: norm_quant_fp8(x, swiglu=True, num_warps=8),
                          jax.ShapeDtypeStruct((M, 2 * F), jnp.bfloat16))
    assert "norm_quant_fp8" in text and "__gpu$xla.gpu.triton" in text


def test_bench_row_quant_cpu_smoke_checks_and_times(tmp_path):
    from benchmarks.kernels import bench_row_quant

    bench_row_quant.main(["--cpu-smoke", "--sites", "norm4096,swiglu14336,splitk4096",
                          "--variants", "w4,w8s", "--out", str(tmp_path)])
    recs = json.loads((tmp_path / "row_quant.json").read_text())
    got = {(r["config"]["site"], r["config"]["variant"]) for r in recs}
    assert got == {("norm4096", "w4"), ("norm4096", "w8s"), ("swiglu14336", "unfused"),
                   ("swiglu14336", "w4"), ("swiglu14336", "w8s"), ("splitk4096", "unfused"),
                   ("splitk4096", "w4"), ("splitk4096", "w8s")}
    assert all("fused_vs_unfused" in r["config"]["checks"] for r in recs
               if r["config"]["site"] != "norm4096")
    assert all(all(r["config"]["checks"].values()) and r["value"] > 0 for r in recs)


def test_bench_row_quant_check_fails_on_a_wrong_variant(tmp_path, monkeypatch):
    from benchmarks.kernels import bench_row_quant

    good = bench_row_quant.site_fn

    def broken(site, variant):  # one pass doubles the scales
        f = good(site, variant)
        return (lambda x, w: (lambda q, s: (q, 2 * s))(*f(x, w))) if variant.endswith("s") else f

    monkeypatch.setattr(bench_row_quant, "site_fn", broken)
    with pytest.raises(SystemExit):
        bench_row_quant.main(["--cpu-smoke", "--sites", "quant4096", "--variants", "w4,w4s",
                              "--out", str(tmp_path)])


@pytest.mark.parametrize("M,K,S", [(1, 4096, 4), (64, 4096, 4), (1, 8192, 2)])
def test_split_k_residual_lowers_for_an_h200(M, K, S):
    """The 8B / 70B decode sites' split-K residual (the o / down GEMMs' partials)."""
    from pallas_kernels.matmul.triton_gemm import SplitKPartials

    sds = jax.ShapeDtypeStruct

    def fn(x, p, xs, ws, w):
        return norm_quant_fp8(x, w, 1e-5, residual=SplitKPartials(p, xs, ws, jnp.bfloat16))

    text = lower_for_cuda(fn, sds((M, K), jnp.bfloat16), sds((S, M, K), F32), sds((M,), F32),
                          sds((K,), F32), sds((K,), jnp.bfloat16))
    assert "norm_quant_fp8" in text and "__gpu$xla.gpu.triton" in text
    assert f"tensor<{S}x{M}x{K}xf32>" in text
