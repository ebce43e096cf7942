"""Pallas paged decode attention vs the jnp reference (interpret mode on CPU).

Every input is fresh random data. Cache slots the kernel must not read (tokens past a
sequence's length, block-table entries past its last page, tokens before its sliding
window, the other layer of the stacked cache) hold NaN in the kernel's input and zeros in
the reference's, so a read of any of them, or an unwritten output, fails the finiteness
check. A last group lowers the kernel for CUDA on this CPU machine to catch what the
interpreter does not check.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_attention import (
    PagedAttentionShapeError,
    paged_decode_attention,
    paged_decode_attention_ref,
    paged_decode_attention_supported,
)
from tests.kernels.cuda_lowering import decode_avals, lower_paged_kernel

LAYER = 1


def make_case(seed: int, *, B: int, G: int, Hkv: int, D: int, ps: int, maxp: int,
              lens: list[int], kv_dtype=jnp.float32, window: int = 0, L: int = 2):
    """Returns (q, k_dirty, v_dirty, k_clean, v_clean, block_tables, seq_lens)."""
    rng = np.random.default_rng(seed)
    P = B * maxp + 3
    k = rng.standard_normal((L, Hkv, P, ps, D)).astype(np.float32)
    v = rng.standard_normal((L, Hkv, P, ps, D)).astype(np.float32)
    q = rng.standard_normal((B, G * Hkv, D)).astype(np.float32)
    bt = rng.permutation(np.arange(1, P))[: B * maxp].reshape(B, maxp).astype(np.int32)
    readable = np.zeros((L, P, ps), bool)  # slots of LAYER the kernel may read
    for b, n in enumerate(lens):
        first = max(n - window, 0) if window > 0 else 0
        for pos in range(first, n):
            readable[LAYER, bt[b, pos // ps], pos % ps] = True
    kd, vd = k.copy(), v.copy()
    kd[~np.broadcast_to(readable[:, None, :, :, None], k.shape)] = np.nan
    vd[~np.broadcast_to(readable[:, None, :, :, None], v.shape)] = np.nan
    kc, vc = np.nan_to_num(kd, nan=0.0), np.nan_to_num(vd, nan=0.0)
    cast = lambda x: jnp.asarray(x, kv_dtype)
    qdt = jnp.float32 if kv_dtype == jnp.float32 else jnp.bfloat16
    return (jnp.asarray(q, qdt), cast(kd), cast(vd), cast(kc), cast(vc), jnp.asarray(bt),
            jnp.asarray(lens, jnp.int32))


def assert_close(out, ref, tight: bool) -> None:
    out = np.asarray(out, np.float64)
    ref = np.asarray(ref, np.float64)
    assert out.shape == ref.shape
    assert np.all(np.isfinite(out)), "non-finite output (unwritten, or a masked slot read)"
    if tight:
        np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4)
    else:
        rel = np.linalg.norm(out - ref) / np.linalg.norm(ref)
        assert rel < 1e-2, rel
        np.testing.assert_allclose(out, ref, atol=6e-2)


def run_both(case, *, scale=0.3, window=0, **kw):
    q, kd, vd, kc, vc, bt, lens = case
    out = paged_decode_attention(q, kd, vd, jnp.int32(LAYER), bt, lens, scale=scale,
                                 window=window, interpret=True, **kw)
    scales = {k: v for k, v in kw.items() if k in ("k_scale", "v_scale")}
    ref = paged_decode_attention_ref(q, kc, vc, jnp.int32(LAYER), bt, lens, scale=scale,
                                     window=window, **scales)
    return out, ref


@pytest.mark.parametrize("G,D,ps,dtype,block_tokens,splits", [
    (1, 64, 16, jnp.float32, 32, None),
    (4, 128, 16, jnp.float32, 32, 3),
    (8, 64, 32, jnp.float32, 64, 1),
    (4, 256, 16, jnp.bfloat16, 16, 2),
    (2, 128, 64, jnp.bfloat16, 128, None),
    (4, 64, 16, jnp.bfloat16, 128, None),
])
def test_matches_reference(G, D, ps, dtype, block_tokens, splits):
    maxp = 4
    lens = [1, ps, 2 * ps, ps + 1, maxp * ps]  # length 1, page boundaries, full table
    case = make_case(G * D + ps, B=len(lens), G=G, Hkv=2, D=D, ps=ps, maxp=maxp, lens=lens,
                     kv_dtype=dtype)
    out, ref = run_both(case, block_tokens=block_tokens, num_splits=splits)
    assert out.dtype == case[0].dtype
    assert_close(out, ref, tight=dtype == jnp.float32)


def test_fp8_kv_with_scales():
    lens = [3, 33, 64]
    case = make_case(7, B=3, G=4, Hkv=2, D=128, ps=16, maxp=4, lens=lens,
                     kv_dtype=jnp.float8_e4m3fn)
    out, ref = run_both(case, k_scale=jnp.float32(0.7), v_scale=jnp.float32(1.9),
                        block_tokens=32, num_splits=2)
    assert_close(out, ref, tight=False)


@pytest.mark.parametrize("window", [1, 5, 16, 49])
def test_sliding_window_static(window):
    lens = [1, 16, 40, 64]
    case = make_case(window, B=4, G=4, Hkv=1, D=64, ps=16, maxp=4, lens=lens, window=window)
    out, ref = run_both(case, window=window, block_tokens=16, num_splits=2)
    assert_close(out, ref, tight=True)


def test_sliding_window_traced_and_layer_traced():
    """window and layer as traced scalars under jit (Gemma 3 alternates windows per layer)."""
    lens = [17, 64]
    case = make_case(3, B=2, G=2, Hkv=2, D=64, ps=16, maxp=4, lens=lens, window=20)
    q, kd, vd, kc, vc, bt, lens_a = case
    f = jax.jit(functools.partial(paged_decode_attention, scale=0.2, interpret=True,
                                  block_tokens=32))
    out = f(q, kd, vd, jnp.int32(LAYER), bt, lens_a, window=jnp.int32(20))
    ref = paged_decode_attention_ref(q, kc, vc, jnp.int32(LAYER), bt, lens_a, scale=0.2,
                                     window=20)
    assert_close(out, ref, tight=True)


def scan_case():
    """(q, k_cache, v_cache, block_tables, lens, L) of the scan-over-layers tests: 3 layers of
    2 KV heads (G 4, D 64), 2 sequences of 30 and 64 tokens over permuted 16-token pages."""
    rng = np.random.default_rng(11)
    L, Hkv, P, ps, D, B = 3, 2, 9, 16, 64, 2
    kc = jnp.asarray(rng.standard_normal((L, Hkv, P, ps, D)), jnp.float32)
    vc = jnp.asarray(rng.standard_normal((L, Hkv, P, ps, D)), jnp.float32)
    q = jnp.asarray(rng.standard_normal((B, 4 * Hkv, D)), jnp.float32)
    bt = jnp.asarray(rng.permutation(np.arange(1, P))[:8].reshape(B, 4), jnp.int32)
    return q, kc, vc, bt, jnp.asarray([30, 64], jnp.int32), L


def test_inside_scan_over_layers():
    """The engine's use: lax.scan over layers with the whole stacked cache."""
    q, kc, vc, bt, lens, L = scan_case()

    def body(_, layer):
        return None, paged_decode_attention(q, kc, vc, layer, bt, lens, scale=0.1,
                                            interpret=True, block_tokens=32)
    _, outs = jax.jit(lambda: jax.lax.scan(body, None, jnp.arange(L, dtype=jnp.int32)))()
    for layer in range(L):
        ref = paged_decode_attention_ref(q, kc, vc, jnp.int32(layer), bt, lens, scale=0.1)
        assert_close(outs[layer], ref, tight=True)


def test_padding_rows_are_zero():
    lens = [0, 5, 0]
    case = make_case(5, B=3, G=4, Hkv=2, D=64, ps=16, maxp=2, lens=lens)
    out, ref = run_both(case, block_tokens=16, num_splits=2)
    assert_close(out, ref, tight=True)
    assert np.all(np.asarray(out)[[0, 2]] == 0)


def test_bad_inputs_raise():
    case = make_case(1, B=2, G=2, Hkv=2, D=64, ps=16, maxp=2, lens=[3, 4])
    q, kd, vd, _, _, bt, lens = case
    with pytest.raises(PagedAttentionShapeError, match="block_tables"):
        paged_decode_attention(q, kd, vd, 1, bt[:1], lens, scale=1.0, interpret=True)
    with pytest.raises(PagedAttentionShapeError, match="int32"):
        paged_decode_attention(q, kd, vd, 1, bt, lens.astype(jnp.int16), scale=1.0,
                               interpret=True)
    with pytest.raises(PagedAttentionShapeError, match="head dim"):
        paged_decode_attention(q[:, :, :32], kd, vd, 1, bt, lens, scale=1.0, interpret=True)


def test_supported():
    assert paged_decode_attention_supported((8, 32, 128), (2, 8, 10, 16, 128), jnp.bfloat16)
    assert paged_decode_attention_supported((8, 8, 256), (2, 4, 10, 64, 256),
                                            jnp.float8_e4m3fn)
    assert not paged_decode_attention_supported((8, 32, 96), (2, 8, 10, 16, 96), jnp.bfloat16)
    assert not paged_decode_attention_supported((8, 30, 128), (2, 8, 10, 16, 128),
                                                jnp.bfloat16)
    assert not paged_decode_attention_supported((8, 32, 128), (2, 8, 10, 16, 128), jnp.int8)
    assert not paged_decode_attention_supported((8, 32, 128), (2, 8, 10, 16, 128), jnp.float32)




@pytest.mark.parametrize("B,Hq,Hkv,D,ps,maxp,kv_dtype,window,kw", [
    (32, 32, 8, 128, 16, 128, jnp.bfloat16, 0, {}),
    (1, 32, 8, 128, 16, 2048, jnp.bfloat16, 0, {}),
    (32, 32, 8, 128, 16, 128, jnp.float8_e4m3fn, "traced", {}),
    (8, 8, 4, 256, 64, 32, jnp.bfloat16, 512, {"block_tokens": 64, "num_stages": 2}),
    (8, 16, 16, 64, 32, 64, jnp.bfloat16, 0, {"num_splits": 1}),
])
def test_lowers_for_cuda(B, Hq, Hkv, D, ps, maxp, kv_dtype, window, kw):
    """Trace and lower for an H200 on this CPU machine (no GPU needed)."""
    args = decode_avals(B, maxp, kv_dtype, Hq=Hq, Hkv=Hkv, D=D, ps=ps)
    text = lower_paged_kernel(paged_decode_attention, args, kv_dtype, window, **kw)
    assert text.count("xla.gpu.triton") == 1


# FP8 KV variants (pallas_kernels/paged_attention/fp8.py): fresh random inputs, NaN-poisoned
# unread slots, permuted pages, ragged lengths (1, page boundaries, full table).
FP8_LENS = [1, 16, 32, 17, 64]


def fp8_case(seed: int, G: int, D: int):
    return make_case(seed, B=len(FP8_LENS), G=G, Hkv=2, D=D, ps=16, maxp=4, lens=FP8_LENS,
                     kv_dtype=jnp.float8_e4m3fn)


@pytest.mark.parametrize("G,D", [(1, 64), (4, 128), (8, 256), (4, 64)])
def test_fp8_bits_widening_equals_cvt(G, D):
    """Bit placement into f16 is exact: the output equals the ``astype`` kernel's bit for bit,
    and both match the reference."""
    case = fp8_case(100 + G * D, G, D)
    kw = dict(k_scale=jnp.float32(0.7), v_scale=jnp.float32(1.9), block_tokens=32,
              num_splits=2)
    out, ref = run_both(case, fp8_widen="bits", **kw)
    base, _ = run_both(case, **kw)
    assert_close(out, ref, tight=False)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(base, np.float32))


@pytest.mark.parametrize("variant", ["qk8", "qk8_bits", "qk8_pv8"])
@pytest.mark.parametrize("G,D,splits", [(1, 64, None), (4, 128, 2), (8, 256, 1)])
def test_fp8_dot_variants(variant, G, D, splits):
    """fp8 x fp8 dots (q quantized per row to e4m3, 3 mantissa bits): not exact, so a bound
    of their own (the ``cvt`` kernel's error is ~5e-4 here); finiteness as everywhere."""
    from pallas_kernels.paged_attention.fp8 import FP8_DECODE_VARIANTS
    case = fp8_case(200 + G * D, G, D)
    out, ref = run_both(case, scale=D ** -0.5, k_scale=jnp.float32(0.7),
                        v_scale=jnp.float32(1.9), block_tokens=32, num_splits=splits,
                        fp8_variant="cvt", **FP8_DECODE_VARIANTS[variant])
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert np.all(np.isfinite(out))
    rel = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    assert rel < 4e-2, rel


def test_fp8_variant_options_checked():
    case = fp8_case(1, 4, 64)
    q, kd, vd, _, _, bt, lens = case
    with pytest.raises(ValueError, match="fp8_widen"):
        paged_decode_attention(q, kd, vd, 1, bt, lens, scale=1.0, interpret=True,
                               fp8_widen="fast")
    with pytest.raises(ValueError, match="f16 only"):
        paged_decode_attention(q, kd, vd, 1, bt, lens, scale=1.0, interpret=True,
                               fp8_widen="bits", fp8_compute_dtype=jnp.bfloat16)


@pytest.mark.parametrize("variant", ["bits", "qk8", "qk8_bits", "qk8_pv8"])
def test_fp8_variants_lower_for_cuda(variant):
    from pallas_kernels.paged_attention.fp8 import FP8_DECODE_VARIANTS
    f8 = jnp.float8_e4m3fn
    args = decode_avals(32, 128, f8)
    text = lower_paged_kernel(paged_decode_attention, args, f8, "traced", fp8_variant="cvt",
                              **FP8_DECODE_VARIANTS[variant])
    assert text.count("xla.gpu.triton") == 1


def test_fp8_variant_table_selects_default(monkeypatch):
    """With both options unset (the engine's call) the kernel runs the table's variant,
    overridable by $JAXINFER_FP8_DECODE; an unknown name raises."""
    from pallas_kernels.paged_attention.fp8 import ENV_VARIANT, FP8_DECODE_VARIANTS
    case = fp8_case(300, 4, 64)
    kw = dict(k_scale=jnp.float32(0.7), v_scale=jnp.float32(1.9), block_tokens=32)
    monkeypatch.setenv(ENV_VARIANT, "qk8_pv8")
    chosen, _ = run_both(case, **kw)
    explicit, _ = run_both(case, **kw, **FP8_DECODE_VARIANTS["qk8_pv8"])
    np.testing.assert_array_equal(np.asarray(chosen, np.float32),
                                  np.asarray(explicit, np.float32))
    monkeypatch.setenv(ENV_VARIANT, "nope")
    with pytest.raises(ValueError, match="unknown FP8 decode variant"):
        run_both(case, **kw)
