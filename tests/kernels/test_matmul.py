"""Matmul kernels (pallas_kernels.matmul) against the float32 jnp reference, on CPU.

The Triton skinny GEMM runs under ``interpret=True`` and the Mosaic GPU wgmma GEMM under
``plgpu.InterpretGPUParams``; both interpreters fill outputs with NaN before the kernel runs
(``jax._src.pallas.primitives.uninitialized_value`` / ``uninitialized_memory="nan"``), so
"every output finite" checks that every element was written. Inputs are fresh random draws,
shapes are deliberately not multiples of the tiles (ragged M and N are masked in the Triton
kernel, M is padded in the wgmma one). A last group lowers each kernel for CUDA under an
abstract H200 to catch hardware-limit violations (shared memory, tile shapes) that the
interpreters do not check.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.matmul import (
    LinearError,
    PreparedWeight,
    gate_up_ref,
    linear,
    linear_ref,
    linear_supported,
    mgpu_gemm,
    prepare_gate_up,
    prepare_weight,
    quantize_rows_fp8,
    triton_gemm,
)
from pallas_kernels.matmul.mgpu_gemm import (
    MgpuConfig,
    decode_config,
    mgpu_decode_linear,
    mgpu_linear,
)
from pallas_kernels.matmul.triton_gemm import TritonConfig, triton_linear
from tests.kernels.cuda_lowering import lower_for_cuda

FP8 = jnp.float8_e4m3fn
F32 = jnp.float32


def rand(seed: int, shape, dtype=jnp.bfloat16, scale: float = 1.0) -> jax.Array:
    return (jax.random.normal(jax.random.key(seed), shape, F32) * scale).astype(dtype)


def rel_err(out, ref) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert np.isfinite(out).all(), "kernel left unwritten (NaN) or non-finite outputs"
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def operands(seed: int, M: int, K: int, N: int, kind: str):
    """x, w_nk, w_scale, x_scale for kind in bf16 / w8a16 / w8a8 (fresh random draws)."""
    x = rand(seed, (M, K))
    w = rand(seed + 1, (N, K), F32, 1 / np.sqrt(K))
    if kind == "bf16":
        return x, w.astype(jnp.bfloat16), None, None
    wq, ws = quantize_rows_fp8(w)
    if kind == "w8a16":
        return x, wq, ws, None
    xq, xs = quantize_rows_fp8(x)
    return xq, wq, ws, xs


# ---------------------------------------------------------------- Triton skinny GEMM
@pytest.mark.parametrize("kind", ["bf16", "w8a16", "w8a8"])
@pytest.mark.parametrize("M,N,cfg", [
    (1, 40, TritonConfig(bm=16, bn=16, bk=64)),
    (5, 72, TritonConfig(bm=16, bn=32, bk=64, split_k=2)),
    (33, 48, TritonConfig(bm=32, bn=16, bk=128)),
    (1, 40, TritonConfig(bm=16, bn=16, bk=64, swap_ab=True)),
    (5, 72, TritonConfig(bm=16, bn=32, bk=64, split_k=2, swap_ab=True, fast_dequant=True)),
    (33, 48, TritonConfig(bm=32, bn=16, bk=128, fast_dequant=True)),
])
def test_triton_matches_reference(kind, M, N, cfg):
    K = 256
    seed = hash((kind, M, N)) % 1000
    x, w, ws, xs = operands(seed, M, K, N, kind)
    out = triton_linear(x, w, ws, xs, config=cfg, out_dtype=F32, interpret=True)
    ref = linear_ref(x, w, ws, xs, out_dtype=F32)
    assert out.shape == (M, N) and out.dtype == F32
    assert rel_err(out, ref) < 1e-5  # same products, float32 sums in another order
    out16 = triton_linear(x, w, ws, xs, config=cfg, interpret=True)
    assert out16.dtype == jnp.bfloat16 and rel_err(out16, ref) < 1e-2


def test_fp8_bits_to_bf16_is_the_exact_conversion():
    u = np.arange(256, dtype=np.uint8)
    u = u[(u & 0x7F) != 0x7F]  # e4m3fn NaNs are not carried
    w = jax.lax.bitcast_convert_type(jnp.asarray(u), FP8)
    fast = np.asarray(triton_gemm.fp8_bits_to_bf16(w).astype(F32))
    exact = np.asarray(w.astype(F32))
    normal = (u & 0x78) != 0
    np.testing.assert_array_equal(fast[normal], exact[normal])
    np.testing.assert_array_equal(np.signbit(fast[normal]), np.signbit(exact[normal]))
    # e4m3 subnormals (|q| < 2^-6) pass through a bf16 subnormal: exact where the multiply
    # keeps subnormals (GPU bf16 arithmetic), zero where it flushes them (XLA:CPU).
    sub = ~normal
    assert np.all((fast[sub] == exact[sub]) | (fast[sub] == 0.0))


@pytest.mark.parametrize("swap_ab,fast", [(True, False), (True, True), (False, True)])
def test_triton_swap_ab_and_fast_dequant_gate_up_stacked(swap_ab, fast):
    M, K, F, L = 17, 256, 40, 2
    x = rand(21, (M, K))
    w = rand(22, (L * 2 * F, K), F32, 1 / 16)
    wq, ws = quantize_rows_fp8(w)
    wq, ws = wq.reshape(L, 2 * F, K), ws.reshape(L, 2 * F)
    for split in (1, 2):
        cfg = TritonConfig(bm=16, bn=32, bk=64, split_k=split, swap_ab=swap_ab,
                           fast_dequant=fast)
        out = triton_linear(x, wq, ws, layer=jnp.int32(1), gate_up=True, config=cfg,
                            out_dtype=F32, interpret=True)
        ref = gate_up_ref(x, wq[1], ws[1], out_dtype=F32)
        assert out.shape == (M, F) and rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("M,cfg", [
    (64, TritonConfig(bm=64, bn=32, bk=128, fp8_dot=True)),
    # swap-AB puts the tokens on the MMA's N side, so the FP8 dot runs at 16 tokens
    (5, TritonConfig(bm=16, bn=32, bk=64, split_k=2, swap_ab=True, fp8_dot=True)),
])
def test_triton_fp8_dot_path(M, cfg):
    K, N = 256, 64
    x, w, ws, xs = operands(7, M, K, N, "w8a8")
    out = triton_linear(x, w, ws, xs, config=cfg, out_dtype=F32, interpret=True)
    assert rel_err(out, linear_ref(x, w, ws, xs, out_dtype=F32)) < 1e-5


@pytest.mark.parametrize("split", [1, 2])
def test_triton_gate_up_and_stacked_layer(split):
    M, K, F, L = 3, 256, 24, 3
    x = rand(11, (M, K))
    w = rand(12, (L, 2 * F, K), F32, 1 / 16)
    wq, ws = quantize_rows_fp8(w.reshape(L * 2 * F, K))
    wq, ws = wq.reshape(L, 2 * F, K), ws.reshape(L, 2 * F)
    cfg = TritonConfig(bm=16, bn=16, bk=64, split_k=split)
    for layer in (0, 2):
        out = triton_linear(x, wq, ws, layer=jnp.int32(layer), gate_up=True, config=cfg,
                            out_dtype=F32, interpret=True)
        ref = gate_up_ref(x, wq[layer], ws[layer], out_dtype=F32)
        assert out.shape == (M, F)
        assert rel_err(out, ref) < 1e-5


def test_triton_rejects_bad_shapes():
    x = rand(0, (4, 96))
    with pytest.raises(ValueError, match="K=96 is not a multiple"):
        triton_linear(x, rand(1, (32, 96)), config=TritonConfig(bk=64), interpret=True)
    with pytest.raises(ValueError, match="weight has K"):
        triton_linear(x, rand(1, (32, 64)), interpret=True)
    with pytest.raises(ValueError, match="need w_scale"):
        triton_linear(x, rand(1, (32, 96)).astype(FP8), interpret=True)


# ---------------------------------------------------------------- Mosaic GPU wgmma GEMM
@pytest.mark.parametrize("kind,tile_k", [("bf16", 64), ("w8a8", 128)])
def test_mgpu_matches_reference(kind, tile_k):
    M, K, N = 50, 256, 128  # M is padded to the 64-row tile
    x, w, ws, xs = operands(21 if kind == "bf16" else 22, M, K, N, kind)
    cfg = MgpuConfig(tile_m=64, tile_n=64, tile_k=tile_k, max_concurrent_steps=2)
    out = mgpu_linear(x, w, ws, xs, config=cfg, out_dtype=F32, interpret=True)
    ref = linear_ref(x, w, ws, xs, out_dtype=F32)
    assert out.shape == (M, N)
    assert rel_err(out, ref) < 1e-5


def test_mgpu_fill_tile_n_rule(monkeypatch):
    """``mgpu_gemm.FILL_TILE_N`` (64 by default): 128 x 128 CTA tiles only where they need
    >= 10 % less full-tile work in waves on the 132 SMs, ceil(2T / 132) / 2 < 0.9
    ceil(T / 132) for T CTA tiles of 128 x 256."""
    assert mgpu_gemm.FILL_TILE_N == 64
    assert mgpu_gemm.default_config(FP8, 512, 4096).tile_n == 64  # T 64: 0.5 vs 1
    assert mgpu_gemm.default_config(FP8, 512, 6144).tile_n == 128  # T 96: 1 vs 1
    assert mgpu_gemm.default_config(FP8, 512, 28672).tile_n == 64  # T 448: 3.5 vs 4
    assert mgpu_gemm.default_config(FP8, 1024, 6144).tile_n == 64  # T 192: 1.5 vs 2
    assert mgpu_gemm.default_config(FP8, 1024, 4096).tile_n == 128  # T 128: 1 vs 1
    assert mgpu_gemm.default_config(FP8, 2048, 4096).tile_n == 128  # T 256: 2 vs 2
    assert mgpu_gemm.default_config(FP8, 8192, 28672).tile_n == 128  # T 7168: 54.5 vs 55
    assert mgpu_gemm.default_config(FP8, 512).tile_n == 128  # N unknown
    assert mgpu_gemm.default_config(FP8, 512, 4096 + 64).tile_n == 128  # N % 128 != 0
    assert mgpu_gemm.default_config(jnp.bfloat16, 512, 4096).tile_k == 64
    monkeypatch.setattr(mgpu_gemm, "FILL_TILE_N", None)  # off
    assert mgpu_gemm.default_config(FP8, 512, 4096).tile_n == 128


@pytest.mark.parametrize("kind", ["bf16", "w8a8"])
def test_mgpu_fill_tiles_match_reference(kind, monkeypatch):
    """With FILL_TILE_N = 64 the default tiles of a small GEMM are 128 x 128 CTA tiles; the
    result still equals the reference (N = 384: three 128-wide CTA tiles, not a multiple
    of the default 256)."""
    monkeypatch.setattr(mgpu_gemm, "FILL_TILE_N", 64)
    M, K, N = 130, 256, 384  # M padded to two 128-row tiles
    assert mgpu_gemm.default_config(FP8, M, N).tile_n == 64
    x, w, ws, xs = operands(27 if kind == "bf16" else 28, M, K, N, kind)
    out = mgpu_linear(x, w, ws, xs, out_dtype=F32, interpret=True)
    assert out.shape == (M, N)
    assert rel_err(out, linear_ref(x, w, ws, xs, out_dtype=F32)) < 1e-5


@pytest.mark.parametrize("kind,split", [("bf16", 1), ("w8a8", 2)])
def test_mgpu_decode_swap_ab_matches_reference(kind, split):
    M, K, N = 5, 512, 128  # tokens padded to 16; split-K partials summed outside
    x, w, ws, xs = operands(23 if kind == "bf16" else 24, M, K, N, kind)
    cfg = decode_config(M, K, N, x.dtype, split_k=split, stages=2)
    out = mgpu_decode_linear(x, w, ws, xs, config=cfg, out_dtype=F32, interpret=True)
    assert out.shape == (M, N)
    assert rel_err(out, linear_ref(x, w, ws, xs, out_dtype=F32)) < 1e-5


@pytest.mark.parametrize("gate_up", [False, True])
def test_linear_mgpu_split_k_sums_the_partials(gate_up):
    """``linear(backend="mgpu")`` with a split-K config (the middle band's small-N shapes)
    adds the float32 partials itself (plain and fused gate+up, W8A8)."""
    M, K, F = 40, 512, 128
    w_kn = rand(25, (K, 2 * F), F32, 1 / np.sqrt(K))
    from jaxinfer.quantization import quantize_fp8_per_channel
    wq, s = quantize_fp8_per_channel(w_kn)
    pw = (prepare_gate_up(wq[:, :F], wq[:, F:], s[:F], s[F:]) if gate_up
          else prepare_weight(wq, s))
    x = rand(26, (M, K))
    cfg = MgpuConfig(tile_m=64, tile_n=64, tile_k=128, max_concurrent_steps=2, split_k=2)
    out = linear(x, pw, act_quant=True, backend="mgpu", mgpu_config=cfg, interpret=True)
    xq, xs = quantize_rows_fp8(x)
    ref = (gate_up_ref if gate_up else linear_ref)(xq, wq.T, s, xs, out_dtype=F32)
    assert out.shape == (M, F if gate_up else 2 * F) and out.dtype == jnp.bfloat16
    assert rel_err(out, ref) < 1e-2


def test_mgpu_rejects_bad_shapes():
    x = rand(0, (8, 128))
    with pytest.raises(ValueError, match="must divide"):
        mgpu_linear(x, rand(1, (96, 128)), interpret=True)
    with pytest.raises(ValueError, match="weight is"):
        mgpu_linear(x, rand(1, (256, 128)).astype(FP8), interpret=True)
    with pytest.raises(ValueError, match="takes bfloat16 or float8_e4m3fn, got float16"):
        mgpu_linear(x.astype(jnp.float16), rand(1, (256, 128)).astype(jnp.float16),
                    interpret=True)


# ---------------------------------------------------------------- engine API
def test_linear_api_bf16_fp8_and_gate_up():
    M, K, F = 6, 128, 40
    x = rand(31, (M, K))
    w_kn = rand(32, (K, 2 * F), F32, 1 / np.sqrt(K))
    pw = prepare_weight(w_kn.astype(jnp.bfloat16))
    assert pw.w.shape == (2 * F, K)
    out = linear(x, pw, backend="triton", interpret=True)
    assert rel_err(out, linear_ref(x, w_kn.T.astype(jnp.bfloat16))) < 1e-2
    # The plain [K, N] array path (XLA) agrees with the kernel.
    out_xla = linear(x, w_kn.astype(jnp.bfloat16))
    assert rel_err(out, out_xla) < 1e-2
    # FP8 weight, W8A16 and W8A8, fused gate+up.
    from jaxinfer.quantization import quantize_fp8_per_channel
    wg, sg = quantize_fp8_per_channel(w_kn[:, :F])
    wu, su = quantize_fp8_per_channel(w_kn[:, F:])
    pgu = prepare_gate_up(wg, wu, sg, su)
    w_nk = jnp.concatenate([wg, wu], axis=1).T
    s = jnp.concatenate([sg, su])
    for act_quant in (False, True):
        out = linear(x, pgu, act_quant=act_quant, backend="triton", interpret=True)
        xq, xs = quantize_rows_fp8(x) if act_quant else (x, None)
        ref = gate_up_ref(xq, w_nk, s, xs, out_dtype=jnp.bfloat16)
        assert out.shape == (M, F) and rel_err(out, ref) < 1e-2
        out_xla = linear(x, pgu, act_quant=act_quant, backend="xla")
        assert rel_err(out_xla, ref) < 1e-2


def test_linear_api_stacked_weight_under_scan():
    L, M, K, N = 3, 4, 64, 32
    ws = rand(41, (L, K, N), F32, 1 / 8).astype(jnp.bfloat16)
    pw = prepare_weight(ws)
    x = rand(42, (M, K))

    def body(h, i):
        return h, linear(h, pw, layer=i, backend="triton", interpret=True)

    _, outs = jax.lax.scan(body, x, jnp.arange(L))
    for i in range(L):
        assert rel_err(outs[i], linear_ref(x, ws[i].T)) < 1e-2


def test_linear_api_errors():
    x = rand(0, (4, 64))
    pw = prepare_weight(rand(1, (64, 32)))
    with pytest.raises(LinearError, match="unknown backend"):
        linear(x, pw, backend="cublas")
    with pytest.raises(LinearError, match="K=64 but the weight has K=48"):
        linear(x, prepare_weight(rand(1, (48, 32))))
    with pytest.raises(LinearError, match="needs an FP8 weight"):
        linear(x, pw, act_quant=True)
    with pytest.raises(LinearError, match="needs `layer`"):
        linear(x, prepare_weight(rand(1, (2, 64, 32))))
    with pytest.raises(LinearError, match="needs a PreparedWeight"):
        linear(x, rand(1, (64, 32)), backend="triton")
    with pytest.raises(LinearError, match="per-channel scale"):
        prepare_weight(rand(1, (64, 32)).astype(FP8))
    # a plain FP8 weight without its scale used to run unscaled on XLA
    with pytest.raises(LinearError, match="per-channel scale"):
        linear(x, rand(1, (64, 32)).astype(FP8))
    wg, s = rand(1, (64, 16)).astype(FP8), jnp.ones((16,), jnp.float32)
    with pytest.raises(LinearError, match="both scales .* got only s_gate"):
        prepare_gate_up(wg, wg, s_gate=s)
    with pytest.raises(LinearError, match="got only s_up"):
        prepare_gate_up(wg, wg, s_up=s)
    assert isinstance(pw, PreparedWeight)


def test_linear_supported_follows_measured_dispatch():
    # Measured on an H200 (NOTES_matmul.md): only W8A8 decode beats XLA.
    assert linear_supported(8, 4096, 6144, FP8, act_quant=True)
    assert linear_supported(64, 14336, 4096, FP8, act_quant=True)
    assert linear_supported(1, 8192, 28672, FP8, act_quant=True)
    assert not linear_supported(1, 4096, 4096, FP8, act_quant=True)  # 8B o_proj at M = 1
    assert not linear_supported(1, 4096, 28672, FP8, act_quant=True, gate_up=True)
    assert not linear_supported(64, 4096, 28672, FP8)  # W8A16: XLA
    assert not linear_supported(1, 4096, 4096, jnp.bfloat16)  # bf16: XLA
    assert not linear_supported(2048, 4096, 6144, FP8, act_quant=True)  # prefill: XLA
    assert not linear_supported(8, 4100, 4096, FP8, act_quant=True)


def test_auto_backend_runs_kernel_and_xla_paths():
    x = rand(51, (8, 256))
    wq, ws = quantize_rows_fp8(rand(52, (64, 256), F32, 1 / 16))
    pw = PreparedWeight(wq, ws)
    xq, xs = quantize_rows_fp8(x)
    ref = linear_ref(xq, wq, ws, xs, out_dtype=jnp.bfloat16)
    out = linear(x, pw, act_quant=True, interpret=True)  # auto -> triton here
    assert rel_err(out, ref) < 1e-2
    out = linear(x, pw, act_quant=False)  # auto -> XLA
    assert rel_err(out, linear_ref(x, wq, ws)) < 1e-2


# ---------------------------------------------------------------- CUDA lowering on the CPU
def sds(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


@pytest.mark.parametrize("M", [1, 8, 64, 256])
@pytest.mark.parametrize("kind", ["bf16", "w8a16", "w8a8"])
def test_triton_lowers_for_cuda(M, kind):
    K, N = 4096, 28672
    wdt = jnp.bfloat16 if kind == "bf16" else FP8
    xdt = FP8 if kind == "w8a8" else jnp.bfloat16
    args = [sds((M, K), xdt), sds((N, K), wdt), sds((N,), F32), sds((M,), F32)]
    for gate_up in (False, True):
        def f(x, w, ws, xs, gate_up=gate_up):
            return triton_linear(x, w, ws if kind != "bf16" else None,
                                 xs if kind == "w8a8" else None, gate_up=gate_up)
        assert "skinny_gemm" in lower_for_cuda(f, *args)


@pytest.mark.parametrize("M", [1, 16, 64])
def test_triton_swap_ab_fast_dequant_lowers_for_cuda(M):
    K, N = 4096, 28672
    cfg = TritonConfig(bm=max(16, M), bn=64, bk=256, split_k=2, swap_ab=True,
                       fast_dequant=True)
    for gate_up in (False, True):
        def f(x, w, ws, gate_up=gate_up):
            return triton_linear(x, w, ws, gate_up=gate_up, config=cfg)
        assert "skinny_gemm" in lower_for_cuda(f, sds((M, K), jnp.bfloat16), sds((N, K), FP8),
                                               sds((N,), F32))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, FP8])
def test_mgpu_lowers_for_cuda(dtype):
    M, K, N = 2048, 4096, 6144
    cfg = mgpu_gemm.default_config(dtype, M)
    scaled = dtype == FP8

    def f(x, w, ws, xs):
        return mgpu_linear(x, w, ws if scaled else None, xs if scaled else None, config=cfg)

    text = lower_for_cuda(f, sds((M, K), dtype), sds((N, K), dtype), sds((N,), F32),
                          sds((M,), F32))
    assert "mosaic_gpu" in text


@pytest.mark.parametrize("M,K,N", [(1, 8192, 28672), (64, 4096, 4096), (128, 14336, 4096),
                                   (256, 4096, 28672)])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, FP8])
def test_mgpu_decode_lowers_for_cuda(M, K, N, dtype):
    scaled = dtype == FP8

    def f(x, w, ws, xs):
        return mgpu_decode_linear(x, w, ws if scaled else None, xs if scaled else None)

    text = lower_for_cuda(f, sds((M, K), dtype), sds((N, K), dtype), sds((N,), F32),
                          sds((M,), F32))
    assert "mosaic_gpu" in text


def test_mid_band_plan_lowers_for_cuda():
    """Every Mosaic GPU job of bench_matmul's ``plan_mid`` (128 / 256 rows, split-K tiles with a
    float32 epilogue) fits an H200's shared memory when lowered through ``linear``."""
    import sys
    sys.path.insert(0, "benchmarks/kernels")
    from matmul_plans import SHAPES, plan_mid

    jobs = [j for j in plan_mid([256], ["8b_o", "8b_gate_up"]) if j[4] != "xla"]
    assert {j[4] for j in jobs} == {"mgpu", "mgpu_decode"}
    assert any(j[5].split_k > 1 for j in jobs if j[4] == "mgpu")
    for sname, M, _, kind, backend, cfg in jobs:
        K, N, gu = SHAPES[sname]
        dt = jnp.bfloat16 if kind == "bf16" else FP8

        def f(x, w, ws, kind=kind, backend=backend, cfg=cfg, gu=gu):
            pw = PreparedWeight(w, None if kind == "bf16" else ws, gu)
            return linear(x, pw, act_quant=kind == "w8a8", backend=backend, mgpu_config=cfg)

        assert "mosaic_gpu" in lower_for_cuda(f, sds((M, K), jnp.bfloat16), sds((N, K), dt),
                                              sds((N,), F32))


def test_m64_plan_lowers_for_cuda():
    """Every Mosaic GPU job of bench_matmul's ``plan_m64`` (64 tokens: the swap-AB kernel
    and the plain orientation with one 64-row tile) fits an H200's shared memory."""
    import sys
    sys.path.insert(0, "benchmarks/kernels")
    from matmul_plans import EXTRA_SHAPES, SHAPES, plan_m64

    jobs = [j for j in plan_m64([64], ["70b_up", "70b_o"]) if j[4] in ("mgpu", "mgpu_decode")]
    assert {j[5].tile_m for j in jobs if j[4] == "mgpu"} == {64}
    assert len([j for j in jobs if j[4] == "mgpu"]) == 8
    for sname, M, _, kind, backend, cfg in jobs:
        K, N, gu = {**SHAPES, **EXTRA_SHAPES}[sname]

        def f(x, w, ws, backend=backend, cfg=cfg, gu=gu):
            return linear(x, PreparedWeight(w, ws, gu), act_quant=True, backend=backend,
                          mgpu_config=cfg)

        assert "mosaic_gpu" in lower_for_cuda(f, sds((M, K), jnp.bfloat16), sds((N, K), FP8),
                                              sds((N,), F32))


def test_m512_plan_lowers_for_cuda():
    """Every Mosaic GPU job of bench_matmul's ``plan_m512`` (512 rows: 128 x 256, 128 x 128
    in 4 and 6 stages, 64 x 256 CTA tiles) fits an H200's shared memory."""
    import sys
    sys.path.insert(0, "benchmarks/kernels")
    from matmul_plans import EXTRA_SHAPES, SHAPES, plan_m512

    jobs = [j for j in plan_m512([512], ["8b_o", "8b_gate_up"]) if j[4] == "mgpu"]
    assert {(j[5].tile_m, j[5].tile_n, j[5].max_concurrent_steps) for j in jobs} == {
        (128, 128, 4), (128, 64, 4), (128, 64, 6), (64, 128, 4)}
    assert {j[0] for j in jobs} == {"8b_o", "8b_gate_up_2f"}
    for sname, M, fam, kind, backend, cfg in jobs:
        if fam == "warmup":
            continue
        K, N, gu = {**SHAPES, **EXTRA_SHAPES}[sname]

        def f(x, w, ws, cfg=cfg, gu=gu):
            return linear(x, PreparedWeight(w, ws, gu), act_quant=True, backend="mgpu",
                          mgpu_config=cfg)

        assert "mosaic_gpu" in lower_for_cuda(f, sds((M, K), jnp.bfloat16), sds((N, K), FP8),
                                              sds((N,), F32))


def test_mgpu_lowering_catches_shared_memory_overflow():
    cfg = MgpuConfig(tile_k=128, max_concurrent_steps=8)

    def f(x, w):
        return mgpu_linear(x, w, config=cfg)

    with pytest.raises(Exception, match="shared memory"):
        lower_for_cuda(f, sds((256, 1024), FP8), sds((256, 1024), FP8))


def test_default_triton_configs_are_valid():
    for M in (1, 8, 32, 64, 128, 256):
        for K, N in ((4096, 6144), (14336, 4096), (8192, 28672)):
            for wdt in (jnp.bfloat16, FP8):
                c = triton_gemm.default_config(M, K, N, wdt, jnp.bfloat16)
                assert K % (c.split_k * c.bk) == 0
                assert min(c.bm, c.bn, c.bk) >= 16


def test_linear_api_per_group_fp8_scales():
    """Block-FP8 layout: per-group scales on the XLA W8A16 path (both of its branches),
    stacked and gate_up weights; kernel backends and W8A8 refuse them."""
    from jaxinfer.quantization import dequantize_fp8_weight, quantize_fp8_weight

    K, N = 256, 48
    w = rand(51, (K, N), F32, 1 / 16) * jnp.logspace(-1, 1, K)[:, None]  # scales differ along K
    q, s = quantize_fp8_weight(w, 64)
    assert s.shape == (K // 64, N)
    deq = dequantize_fp8_weight(q, s)
    pw = prepare_weight(q, s)
    assert pw.grouped and pw.scale.shape == (N, K // 64)
    for M in (3, 40):  # grouped dots / dequantize-first
        x = rand(52 + M, (M, K), F32)
        want = np.asarray(x, np.float64) @ np.asarray(deq, np.float64)
        for out in (linear(x, pw), linear(x, q, s)):
            assert out.shape == (M, N) and rel_err(out, want) < 1e-5
    # stacked, under a layer index
    qs, ss = jnp.stack([q, q * -1]), jnp.stack([s, s * 2])
    ps = prepare_weight(qs, ss)
    x = rand(60, (5, K), F32)
    assert rel_err(linear(x, ps, layer=1), np.asarray(x) @ (np.asarray(deq) * -2)) < 1e-5
    # gate_up with per-group scales
    F = N // 2
    pgu = prepare_gate_up(q[:, :F], q[:, F:], s[:, :F], s[:, F:])
    ref = gate_up_ref(x, deq.T, out_dtype=F32)
    assert rel_err(linear(x, pgu), ref) < 1e-5
    with pytest.raises(LinearError, match="per-group weight scales run W8A16 on the XLA path"):
        linear(x.astype(jnp.bfloat16), pw, act_quant=True)
    with pytest.raises(LinearError, match="per-group weight scales"):
        linear(x.astype(jnp.bfloat16), pw, backend="triton", interpret=True)
    with pytest.raises(LinearError, match=r"per group .*'G', 48\) with G dividing 256"):
        prepare_weight(q, s[:3])
