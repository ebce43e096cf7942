"""FP8 quantization utilities (jaxinfer.quantization) on random inputs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxinfer.quantization import (
    FP8,
    FP8_MAX,
    QuantizationError,
    dequantize_fp8,
    dequantize_fp8_weight,
    fp8_group_size,
    fp8_linear_ref,
    fp8_weight_linear,
    quantize_fp8_per_channel,
    quantize_fp8_per_token,
    quantize_fp8_weight,
    quantize_params_fp8,
)


def rand(seed, shape, scale=1.0, dtype=jnp.float32):
    return (jax.random.normal(jax.random.key(seed), shape, jnp.float32) * scale).astype(dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_per_channel_roundtrip_and_scale(dtype):
    K, N = 96, 40
    # Columns of very different magnitude: each must get its own scale.
    w = rand(1, (K, N), dtype=jnp.float32) * jnp.logspace(-3, 2, N)[None, :]
    w = w.astype(dtype)
    q, s = quantize_fp8_per_channel(w)
    assert q.shape == (K, N) and q.dtype == FP8
    assert s.shape == (N,) and s.dtype == jnp.float32
    wf = np.asarray(w, np.float64)
    np.testing.assert_allclose(np.asarray(s), np.abs(wf).max(axis=0) / FP8_MAX, rtol=1e-6)
    # Each column's absmax maps to +-448 exactly; no value exceeds it.
    qf = np.asarray(q, np.float64)
    np.testing.assert_allclose(np.abs(qf).max(axis=0), FP8_MAX)
    # e4m3 keeps 3 mantissa bits: relative rounding error <= 2^-4 above the subnormals
    # (|q| >= 2^-6), absolute error <= half a subnormal step (2^-10) * scale below.
    deq = np.asarray(dequantize_fp8(q, s, axis=1), np.float64)
    err = np.abs(deq - wf)
    normal = np.abs(qf) >= 2.0 ** -6
    assert (err[normal] <= 2.0 ** -4 * np.abs(wf[normal]) + 1e-30).all()
    sub_bound = (2.0 ** -10) * np.broadcast_to(np.asarray(s, np.float64)[None, :], wf.shape)
    assert (err[~normal] <= sub_bound[~normal] * 1.0001).all()


def test_per_token_shapes_and_roundtrip():
    x = rand(2, (7, 64), scale=3.0, dtype=jnp.bfloat16)
    q, s = quantize_fp8_per_token(x)
    assert q.shape == (7, 64) and q.dtype == FP8 and s.shape == (7,)
    xf = np.asarray(x, np.float64)
    np.testing.assert_allclose(np.asarray(s), np.abs(xf).max(axis=1) / FP8_MAX, rtol=1e-6)
    deq = np.asarray(dequantize_fp8(q, s, axis=0), np.float64)
    assert np.linalg.norm(deq - xf) / np.linalg.norm(xf) < 0.05


def test_zero_rows_get_finite_scale():
    x = jnp.zeros((3, 32), jnp.float32).at[1].set(rand(3, (32,)))
    q, s = quantize_fp8_per_token(x)
    assert np.isfinite(np.asarray(s)).all() and (np.asarray(s) > 0).all()
    assert not np.asarray(q[0], np.float32).any() and not np.asarray(q[2], np.float32).any()


def test_fp8_linear_ref_matches_float32_math():
    M, K, N = 5, 128, 24
    x = rand(4, (M, K), dtype=jnp.bfloat16)
    w = rand(5, (K, N), scale=1 / np.sqrt(K))
    wq, ws = quantize_fp8_per_channel(w)
    exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    # W8A16: only the weight is rounded.
    w8a16 = np.asarray(fp8_linear_ref(x, wq, ws), np.float64)
    manual = np.asarray(x, np.float64) @ (np.asarray(wq, np.float64) * np.asarray(ws)[None, :])
    assert np.linalg.norm(w8a16 - manual) / np.linalg.norm(manual) < 8e-3  # bf16 output
    # Both quantized: close to the exact product, and not identical to W8A16.
    w8a8 = np.asarray(fp8_linear_ref(x, wq, ws, act_quant=True), np.float64)
    for out in (w8a16, w8a8):
        assert np.linalg.norm(out - exact) / np.linalg.norm(exact) < 0.06
    assert not np.array_equal(w8a8, w8a16)


def test_bad_inputs_raise():
    with pytest.raises(QuantizationError, match="must be 2-D"):
        quantize_fp8_per_channel(jnp.ones((4,)))
    with pytest.raises(QuantizationError, match="bf16/f16/f32"):
        quantize_fp8_per_token(jnp.ones((4, 4), jnp.int32))
    with pytest.raises(QuantizationError, match="float8_e4m3fn"):
        fp8_linear_ref(jnp.ones((2, 4)), jnp.ones((4, 3)), jnp.ones((3,)))


def test_rounding_is_nearest_even_and_saturating():
    # 1.0625 / 1.1875 are halfway between e4m3 neighbours (steps of 0.125): ties go to the
    # even mantissa; the column's absmax maps to 448 exactly, nothing overflows to NaN.
    w = jnp.asarray([[448.0], [1.0625 * 448 / 448], [1.1875], [-17.0], [19.0]], jnp.float32)
    q, s = quantize_fp8_per_channel(w)
    assert float(s[0]) == 1.0
    np.testing.assert_array_equal(np.asarray(q, np.float32)[:, 0], [448.0, 1.0, 1.25, -16.0, 20.0])
    np.testing.assert_array_equal(np.asarray(q, np.float32),
                                  np.asarray(w).astype(ml_dtypes.float8_e4m3fn)
                                  .astype(np.float32))


def test_group_size_rule():
    assert fp8_group_size(4096, None) is None
    assert fp8_group_size(4096, 128) == 128
    assert fp8_group_size(576, 128) == 64  # SmolLM2's hidden size: gcd
    assert fp8_group_size(128, 128) is None  # one group covers K: per channel
    assert fp8_group_size(100, 128) is None  # gcd 4 < 16: per channel
    with pytest.raises(QuantizationError, match="positive integer or None"):
        fp8_group_size(64, 0)


def test_grouped_quantization_layout_and_linear():
    K, N, g = 256, 24, 64
    # rows of very different magnitude along K: each group gets its own scale
    w = rand(7, (K, N)) * jnp.repeat(jnp.asarray([1e-5, 1.0, 30.0, 0.2]), g)[:, None]
    q, s = quantize_fp8_weight(w, g)
    assert q.shape == (K, N) and q.dtype == FP8 and s.shape == (K // g, N)
    wf = np.asarray(w, np.float64)
    np.testing.assert_allclose(np.asarray(s), np.abs(wf).reshape(K // g, g, N).max(1) / FP8_MAX,
                               rtol=1e-6)
    qf = np.asarray(q, np.float64).reshape(K // g, g, N)
    np.testing.assert_allclose(np.abs(qf).max(1), FP8_MAX)  # each group's absmax -> 448
    deq = np.asarray(dequantize_fp8_weight(q, s), np.float64)
    np.testing.assert_allclose(deq, qf.reshape(K, N) * np.repeat(np.asarray(s), g, 0))
    rel = np.abs(deq - wf) / np.maximum(np.abs(wf), 1e-30)
    assert (rel[np.abs(qf.reshape(K, N)) >= 2.0 ** -6] <= 2.0 ** -4).all()
    # per channel flushes the 1e-5 rows (below e4m3's normal range under the column absmax):
    # their own group scale keeps every one within 2^-4
    assert (rel[:g] <= 2.0 ** -4).all()
    qc, sc = quantize_fp8_per_channel(w)
    rel_c = np.abs(np.asarray(dequantize_fp8_weight(qc, sc)) - wf) / np.abs(wf)
    assert np.median(rel_c[:g]) > 0.5
    for M in (2, 40):  # both branches of the W8A16 GEMM
        x = rand(8 + M, (M, K))
        out = np.asarray(fp8_weight_linear(x, q, s), np.float64)
        np.testing.assert_allclose(out, np.asarray(x, np.float64) @ deq, rtol=2e-5,
                                   atol=2e-5 * np.abs(out).max())
    with pytest.raises(QuantizationError, match=r"does not fit an FP8 weight of shape \(256, 24\)"):
        dequantize_fp8_weight(q, s[:, :5])
    with pytest.raises(QuantizationError, match="G dividing 256"):
        fp8_weight_linear(x, q, jnp.ones((3, N)))


def test_quantize_params_fp8_layers_and_passthrough():
    rng = np.random.default_rng(0)
    params = {"a": rng.standard_normal((2, 128, 16)).astype(np.float32),
              "b": rng.standard_normal((2, 32, 8)).astype(np.float32),
              "norm": np.ones(4, np.float32)}
    out = quantize_params_fp8(params, ["a", "b"], group_size=64)
    assert isinstance(out["a"], np.ndarray) and out["a"].dtype == FP8
    assert out["a_scale"].shape == (2, 2, 16) and out["b_scale"].shape == (2, 8)  # K=32: channel
    for i in range(2):
        q, s = quantize_fp8_weight(jnp.asarray(params["a"][i]), 64)
        np.testing.assert_array_equal(out["a"][i].view(np.uint8), np.asarray(q).view(np.uint8))
        np.testing.assert_array_equal(out["a_scale"][i], np.asarray(s))
    assert out["norm"] is params["norm"]
    again = quantize_params_fp8(out, ["a", "b"])  # already e4m3: passed through
    assert again["a"] is out["a"] and again["a_scale"] is out["a_scale"]
    dev = quantize_params_fp8({"a": jnp.asarray(params["a"])}, ["a"])
    assert isinstance(dev["a"], jax.Array) and dev["a_scale"].shape == (2, 16)
