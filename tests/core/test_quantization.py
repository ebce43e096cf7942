"""FP8 quantization utilities (jaxinfer.quantization) on random inputs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.quantization import (
    FP8,
    FP8_MAX,
    QuantizationError,
    dequantize_fp8,
    fp8_linear_ref,
    quantize_fp8_per_channel,
    quantize_fp8_per_token,
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
