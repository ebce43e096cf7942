"""The Triton decode GEMM's session-10 options, in interpret mode on fresh random inputs
against float32 references: x quantized to FP8 inside the kernel per token and group of K
columns (``act_group``), the split-K partials merged by the last-arriving split inside the
kernel (``merge``), and the engine's FP8 gate_up form (SwiGLU in the GEMM's epilogue up to
``fp8_plan.FP8_GATE_UP_EPILOGUE_MAX_M`` rows)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.matmul import (
    api,
    fp8_plan,
    gate_up_ref,
    linear_ref,
    quantize_row_groups_fp8,
    quantize_rows_fp8,
)
from pallas_kernels.matmul.triton_gemm import TritonConfig, triton_linear
from tests.kernels.cuda_lowering import lower_for_cuda
from tests.kernels.test_matmul import F32, FP8, rand, rel_err


def fp8_weight(seed: int, rows: int, K: int):
    return quantize_rows_fp8(rand(seed, (rows, K), F32, 1 / np.sqrt(K)))


def test_quantize_row_groups_fp8_is_per_token_per_group():
    x = rand(1, (3, 256), F32)
    x = x.at[1, 128:].multiply(1000.0)  # one group of one row far larger than the rest
    q, s = quantize_row_groups_fp8(x, 128)
    assert q.dtype == FP8 and q.shape == (3, 256) and s.shape == (3, 2)
    xg = np.asarray(x, np.float64).reshape(3, 2, 128)
    np.testing.assert_allclose(np.asarray(s), np.abs(xg).max(-1) / 448.0, rtol=1e-6)
    deq = np.asarray(q, np.float64).reshape(3, 2, 128) * np.asarray(s, np.float64)[..., None]
    # e4m3 keeps 3 mantissa bits: each value within 2^-4 of itself (relative), or below the
    # group's smallest normal step
    err = np.abs(deq - xg)
    assert np.all(err <= np.maximum(np.abs(xg) * 2.0 ** -4,
                                    np.asarray(s, np.float64)[..., None] * 2.0 ** -9) * 1.0001)
    assert np.abs(np.asarray(q[1, :128], F32)).max() == 448.0  # the small group keeps its range
    with pytest.raises(ValueError, match="does not divide"):
        quantize_row_groups_fp8(x, 96)


def test_linear_ref_with_group_scales_is_the_sum_of_scaled_group_dots():
    xq, xs = quantize_row_groups_fp8(rand(2, (4, 256)), 64)
    wq, ws = fp8_weight(3, 24, 256)
    out = linear_ref(xq, wq, ws, xs, out_dtype=F32)
    want = sum(np.asarray(xq[:, 64 * g:64 * (g + 1)], np.float64)
               @ np.asarray(wq[:, 64 * g:64 * (g + 1)], np.float64).T
               * np.asarray(xs[:, g], np.float64)[:, None] for g in range(4))
    want = want * np.asarray(ws, np.float64)[None, :]
    np.testing.assert_allclose(np.asarray(out, np.float64), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("M,N,split,gate_up,swap_ab", [
    (1, 96, 2, False, True), (5, 64, 4, False, True), (16, 128, 1, False, True),
    (20, 72, 2, False, True), (3, 64, 2, True, True), (33, 48, 2, True, True),
    (7, 40, 2, False, False)])
def test_in_kernel_group_quantization_and_merge(M, N, split, gate_up, swap_ab):
    """act_group=128 (+ merge): bf16 x goes into the kernel, which must equal the FP8 dot of
    x quantized per token and 128 columns; with and without the in-kernel split merge; ragged
    M and N (not multiples of the tiles), gate_up, both MMA orientations."""
    K = 1024 if split == 4 else 512
    x = rand(M * 31 + N, (M, K))
    wq, ws = fp8_weight(M + N, N, K)
    xq, xs = quantize_row_groups_fp8(x, 128)
    ref = (gate_up_ref if gate_up else linear_ref)(xq, wq, ws, xs, out_dtype=F32)
    bm = 64 if not swap_ab else 16
    for merge in (True, False):
        cfg = TritonConfig(bm=bm, bn=32, bk=256, split_k=split, fp8_dot=True,
                           swap_ab=swap_ab, act_group=128, merge=merge)
        out = triton_linear(x, wq, ws, gate_up=gate_up, config=cfg, out_dtype=F32,
                            interpret=True)
        assert out.shape == ref.shape
        assert rel_err(out, ref) < 1e-5, (merge, rel_err(out, ref))


@pytest.mark.parametrize("kind", ["bf16", "w8a8"])
@pytest.mark.parametrize("split,gate_up", [(2, False), (4, False), (2, True)])
def test_in_kernel_merge_equals_the_xla_epilogue(kind, split, gate_up):
    """merge=True: the last split to arrive sums the partials in a fixed order and runs the
    scales / SwiGLU / cast in the kernel: the same as the XLA epilogue fusion's result."""
    M, K, N = 9, 1024, 80
    x = rand(40 + split, (M, K))
    if kind == "bf16":
        w, ws, xin, xs = rand(41, (N, K), jnp.bfloat16, 1 / 32), None, x, None
    else:
        w, ws = fp8_weight(41, N, K)
        xin, xs = quantize_rows_fp8(x)
    outs = []
    for merge in (False, True):
        cfg = TritonConfig(bm=16, bn=32, bk=128, split_k=split, swap_ab=True,
                           fp8_dot=kind == "w8a8", merge=merge)
        outs.append(triton_linear(xin, w, ws, xs, gate_up=gate_up, config=cfg,
                                  out_dtype=F32, interpret=True))
    ref = (gate_up_ref if gate_up else linear_ref)(xin, w, ws, xs, out_dtype=F32)
    assert rel_err(outs[1], ref) < 1e-5 and rel_err(outs[0], ref) < 1e-5
    np.testing.assert_allclose(np.asarray(outs[1]), np.asarray(outs[0]), rtol=1e-5, atol=1e-6)


def test_act_group_and_merge_options_are_validated():
    x = rand(0, (4, 512))
    wq, ws = fp8_weight(1, 64, 512)
    cfg = TritonConfig(bm=16, bn=32, bk=256, fp8_dot=True, swap_ab=True, act_group=128)
    xq, xs = quantize_rows_fp8(x)
    with pytest.raises(ValueError, match="act_group=128 needs"):  # x already FP8
        triton_linear(xq, wq, ws, xs, config=cfg, interpret=True)
    with pytest.raises(ValueError, match="act_group=128 needs"):  # bf16 weight
        triton_linear(x, rand(2, (64, 512)), config=cfg, interpret=True)
    with pytest.raises(ValueError, match="act_group=96 needs"):  # does not divide bk
        triton_linear(x, wq, ws, config=dataclasses.replace(cfg, act_group=96),
                      interpret=True)
    pw = api.PreparedWeight(wq, ws)
    with pytest.raises(api.LinearError, match="needs act_quant"):
        api.linear(x, pw, act_group=128, backend="xla")
    with pytest.raises(api.LinearError, match="runs on backend"):
        api.linear(x, pw, act_quant=True, act_group=128, backend="mgpu")
    with pytest.raises(api.LinearError, match="quantizes with act_group=128"):
        api.linear(x, pw, act_quant=True, backend="triton", triton_config=cfg)
    with pytest.raises(api.LinearError, match="fuse must be"):
        fp8_plan.fp8_decode_config(4, 512, 64, fuse="some")


def test_linear_act_group_on_xla_and_triton_agree():
    """The same W8A8-per-group math on XLA (quantize, grouped dot) and in the kernel."""
    M, K, N = 6, 512, 96
    x = rand(5, (M, K))
    wq, ws = fp8_weight(6, N, K)
    pw = api.PreparedWeight(wq, ws)
    cfg = TritonConfig(bm=16, bn=32, bk=256, split_k=2, fp8_dot=True, swap_ab=True,
                       act_group=128, merge=True)
    tri = api.linear(x.astype(F32), pw, act_quant=True, act_group=128, backend="triton",
                     triton_config=cfg, interpret=True)
    xla = api.linear(x.astype(F32), pw, act_quant=True, act_group=128, backend="xla")
    xq, xs = quantize_row_groups_fp8(x.astype(F32), 128)
    ref = linear_ref(xq, wq, ws, xs, out_dtype=F32)
    assert rel_err(tri, ref) < 1e-5 and rel_err(xla, ref) < 1e-5


@pytest.mark.parametrize("fuse", ["all", "merge", "none"])
def test_decode_config_follows_the_fuse_choice(fuse, monkeypatch):
    monkeypatch.setenv("JAXINFER_FP8_DECODE_FUSE", fuse)
    for M, K, N in [(1, 4096, 6144), (16, 14336, 4096), (64, 4096, 14336)]:
        cfg = fp8_plan.fp8_decode_config(M, K, N, gate_up=N == 14336)
        assert cfg.merge == (fuse != "none")
        assert cfg.act_group == (128 if fuse == "all" else 0)
        assert cfg.swap_ab and cfg.fp8_dot and K % (cfg.split_k * cfg.bk) == 0
    assert fp8_plan.fp8_decode_config(1, 4096 + 64, 64).act_group == 0  # 128 does not divide K
    monkeypatch.setenv("JAXINFER_FP8_DECODE_FUSE", "fast")
    with pytest.raises(api.LinearError, match="JAXINFER_FP8_DECODE_FUSE"):
        fp8_plan.fp8_engine_plan(300, 4096, 4096)  # validated at every row count


@pytest.mark.parametrize("M,kernel", [(8, "triton"), (37, "triton"), (128, "mgpu_decode")])
def test_engine_gate_up_form(M, kernel):
    """fp8_engine_linear(gate_up=True) == silu(x Wgᵀ) * (x Wuᵀ) with per-token W8A8: SwiGLU
    in the Triton GEMM's epilogue up to FP8_GATE_UP_EPILOGUE_MAX_M rows, after the [M, 2F]
    GEMM above it (and on the Mosaic middle band)."""
    K, F = 256, 256
    x = rand(M, (M, K))
    wq, ws = fp8_weight(M + 1, 2 * F, K)
    assert fp8_plan.fp8_engine_plan(M, K, 2 * F) == (kernel, True)
    out = fp8_plan.fp8_engine_linear(x, wq, ws, gate_up=True, interpret=True)
    xq, xs = quantize_rows_fp8(x)
    ref = gate_up_ref(xq, wq, ws, xs, out_dtype=F32)
    assert out.shape == (M, F) and out.dtype == jnp.bfloat16
    assert rel_err(out, ref) < 1e-2  # bf16 output (and bf16 gate / up above 16 rows)
    avals = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (x, wq, ws)]
    text = lower_for_cuda(functools.partial(fp8_plan.fp8_engine_linear, gate_up=True), *avals)
    assert ("skinny_gemm" in text) == (kernel == "triton")
    with pytest.raises(api.LinearError, match="even row count"):
        fp8_plan.fp8_engine_linear(x, wq[:-1], ws[:-1], gate_up=True, interpret=True)


@pytest.mark.parametrize("M", [1, 16, 64])
def test_fused_configs_lower_for_cuda_at_llama_shapes(M):
    """Every fuse choice's config at the Llama-3.1-8B projections lowers for an H200 (the
    H200 compiled and checked them all in session 10's bench_matmul --plan fused)."""
    sds = jax.ShapeDtypeStruct
    for K, N, gu in [(4096, 6144, False), (4096, 28672, True), (14336, 4096, False)]:
        for fuse in ("all", "merge"):
            cfg = fp8_plan.fp8_decode_config(M, K, N // 2 if gu else N, gu, fuse)
            fn = functools.partial(triton_linear, gate_up=gu, config=cfg)
            text = lower_for_cuda(fn, sds((M, K), jnp.bfloat16), sds((N, K), FP8),
                                  sds((N,), F32)) if cfg.act_group else lower_for_cuda(
                functools.partial(triton_linear, gate_up=gu, config=cfg),
                sds((M, K), FP8), sds((N, K), FP8), sds((N,), F32), sds((M,), F32))
            assert "skinny_gemm" in text
            # the in-kernel merge's arrival counter (an op name in the serialized Triton IR)
            assert ("atomic_rmw" in text) == (cfg.split_k > 1)


def test_decode_config_takes_deep_k_steps_only_for_large_weights_at_few_tokens():
    """FP8_DECODE_DEEP_K: 512 K a step in 3 stages where M <= 16, not gate_up, and each
    program still walks >= FP8_DECODE_DEEP_K_MIN_STEPS steps; the 256 / 4-stage tiles
    otherwise and with deep_k=False."""
    cfg = fp8_plan.fp8_decode_config
    assert not fp8_plan.FP8_DECODE_DEEP_K  # off by default since session 14 (fp8_plan)
    assert cfg(1, 8192, 28672, fuse="none").bk == 256
    for M, K, N in [(1, 8192, 28672), (16, 14336, 4096), (1, 8192, 8192), (1, 28672, 8192)]:
        c = cfg(M, K, N, fuse="none", deep_k=True)
        assert (c.bk, c.num_stages) == (512, 3) and K // (c.split_k * 512) >= 4, (M, K, N, c)
        old = cfg(M, K, N, fuse="none", deep_k=False, tiles="wave2")  # session 11's tiles
        assert (old.bk, old.num_stages) == (256, 4) and old.split_k >= c.split_k
    for M, K, N, gu in [(1, 4096, 6144, False), (1, 4096, 4096, False), (64, 8192, 28672, False),
                        (1, 4096, 14336, True), (1, 8192, 28672, True)]:
        c = cfg(M, K, N, gu, fuse="none", tiles="wave2")  # (wave15's stages: fast_accum's test)
        assert (c.bk, c.num_stages) == (256, 4), (M, K, N, gu, c)
    assert cfg(1, 8192, 28672, fuse="all").bk == 256  # in-kernel groups keep their tiles


def test_decode_tiles_wave15_against_wave2(monkeypatch):
    """FP8_DECODE_TILES (session 13's sweep): "wave15" splits K only until
    FP8_DECODE_SPLIT_TARGET programs and at >= 32 tokens takes 3 stages, 128 weight rows
    where N >= FP8_DECODE_WIDE_N; "wave2" is session 12's (2 waves, 64 rows, 4 stages).
    The H200 sweep's winners are what wave15 picks at these Llama-3.1 shapes."""
    monkeypatch.delenv("JAXINFER_FP8_DECODE_FAST_ACCUM", raising=False)
    monkeypatch.setattr(fp8_plan, "FP8_DECODE_FAST_ACCUM", False)  # the sweep's mma.sync dots
    cfg = fp8_plan.fp8_decode_config
    picks = {  # (M, K, N, gate_up): (bn, bk, split, stages), the sweep's best or within 5 %
        (16, 4096, 14336, True): (64, 256, 1, 4),     # 8B gate_up + SwiGLU: 32.7 vs 36.4 us
        (16, 8192, 8192, False): (64, 512, 2, 3),     # 70B o: 256 programs (this tile not
        # measured; bn 32 / split 1 20.0, bn 64 / bk 256 / split 2 20.8 vs 23.8 us at 512)
        (32, 8192, 28672, False): (128, 256, 1, 3),   # 70B up: 59.6 vs 84.5 us
        (32, 4096, 28672, False): (128, 256, 1, 3),   # 8B gate_up as one [2F, K] GEMM
        (64, 8192, 28672, False): (128, 256, 1, 3),
        (32, 14336, 4096, False): (64, 256, 4, 3),    # 8B down
        (32, 4096, 6144, False): (64, 256, 4, 3),     # 8B qkv: 11.7 vs 12.5 us
        (64, 4096, 4096, False): (64, 256, 4, 3),     # 8B o
    }
    for (M, K, N, gu), want in picks.items():
        c = cfg(M, K, N, gu, fuse="none", tiles="wave15", deep_k=True)  # as swept
        assert (c.bn, c.bk, c.split_k, c.num_stages) == want, (M, K, N, gu, c)
        old = cfg(M, K, N, gu, fuse="none", tiles="wave2", deep_k=M <= 16)
        programs = lambda t: -(-N // t.bn) * t.split_k  # noqa: E731
        assert old.bn == 64 and programs(old) >= 264 > programs(c) >= 198 or (
            programs(old) == programs(c) and old.split_k == c.split_k), (M, K, N, old, c)
        assert old.num_stages == (4 if old.bk == 256 else 3)
    with pytest.raises(api.LinearError, match="tiles must be"):
        cfg(1, 4096, 4096, tiles="wide")


def test_64_token_tiles_of_the_wide_weights_take_64_rows_on_wgmma(monkeypatch):
    """Session 31's H200 measurement (bench_matmul --plan m64): at 64 tokens with the FP8
    dot on wgmma, 64 weight rows x 256 K in 3 stages (70B up 63.1 vs 72.0 us on 128 rows in
    2); 32 tokens keep 128-row mma.sync tiles; with the wgmma dot off, 64 tokens too."""
    monkeypatch.delenv("JAXINFER_FP8_DECODE_FAST_ACCUM", raising=False)
    monkeypatch.setattr(fp8_plan, "FP8_DECODE_FAST_ACCUM", True)
    cfg = fp8_plan.fp8_decode_config
    for K, N in ((8192, 28672), (4096, 28672), (8192, 57344)):
        c = cfg(64, K, N, fuse="none")
        assert (c.bn, c.bk, c.split_k, c.num_stages, c.fast_accum) == (64, 256, 1, 3, True), c
        c32 = cfg(32, K, N, fuse="none")
        assert (c32.bn, c32.num_stages, c32.fast_accum) == (128, 3, False), c32
    monkeypatch.setenv("JAXINFER_FP8_DECODE_ROWS_AT_64", "128")  # session 13's, for an A/B
    c = cfg(64, 8192, 28672, fuse="none")
    assert (c.bn, c.num_stages, c.fast_accum) == (128, 2, True), c
    from jaxinfer.compile_cache import kernel_env

    assert kernel_env()["JAXINFER_FP8_DECODE_ROWS_AT_64"] == "128"  # in the cache fingerprint
    monkeypatch.delenv("JAXINFER_FP8_DECODE_ROWS_AT_64")
    monkeypatch.setattr(fp8_plan, "FP8_DECODE_ROWS_AT_64", 128)  # the constant, as --patch
    c = cfg(64, 8192, 28672, fuse="none")
    assert (c.bn, c.num_stages, c.fast_accum) == (128, 2, True), c
    monkeypatch.setattr(fp8_plan, "FP8_DECODE_FAST_ACCUM", False)
    c = cfg(64, 8192, 28672, fuse="none")
    assert (c.bn, c.num_stages, c.fast_accum) == (128, 3, False), c


def test_decode_tiles_follow_the_environment(monkeypatch):
    from jaxinfer.compile_cache import kernel_env

    monkeypatch.setenv("JAXINFER_FP8_DECODE_TILES", "wave2")
    assert fp8_plan.fp8_decode_config(32, 8192, 28672, fuse="none").bn == 64
    assert kernel_env()["JAXINFER_FP8_DECODE_TILES"] == "wave2"  # in the cache fingerprint
    monkeypatch.delenv("JAXINFER_FP8_DECODE_TILES")
    assert fp8_plan.fp8_decode_config(32, 8192, 28672, fuse="none").bn == 128
    monkeypatch.setenv("JAXINFER_FP8_DECODE_TILES", "wide")
    with pytest.raises(api.LinearError, match="JAXINFER_FP8_DECODE_TILES"):
        fp8_plan.fp8_engine_plan(1, 8192, 28672)


@pytest.mark.parametrize("M,N,fast", [(20, 300, True), (33, 257, False), (33, 257, True)])
def test_wide_tiles_match_the_reference(monkeypatch, M, N, fast):
    """wave15's tiles for wide N at 17-64 tokens (FP8_DECODE_WIDE_N lowered so a small
    ragged N takes them; split 1 and 2): 128 weight rows in 3 stages with mma.sync dots, and
    at 64 tokens with the FP8 dot on wgmma 64 rows in 3 stages (session 31). W8A8 as the
    engine calls it: equal to the float32 reference (interpret mode)."""
    monkeypatch.setattr(fp8_plan, "FP8_DECODE_WIDE_N", 256)
    monkeypatch.setattr(fp8_plan, "FP8_DECODE_FAST_ACCUM", fast)
    monkeypatch.delenv("JAXINFER_FP8_DECODE_FAST_ACCUM", raising=False)
    K = 2048
    c = fp8_plan.fp8_decode_config(M, K, N, fuse="none", tiles="wave15")
    wgmma64 = fast and c.bm == 64
    assert (c.bn, c.num_stages, c.fast_accum) == ((64, 3, True) if wgmma64 else (128, 3, False)), c
    x = rand(M + N, (M, K))
    wq, ws = fp8_weight(3 * M + N, N, K)
    xq, xs = quantize_rows_fp8(x)
    ref = linear_ref(xq, wq, ws, xs, out_dtype=F32)
    for split in (1, 2):
        out = triton_linear(xq, wq, ws, x_scale=xs, config=dataclasses.replace(c, split_k=split),
                            out_dtype=F32, interpret=True)
        assert out.shape == ref.shape and rel_err(out, ref) < 1e-5, (split, rel_err(out, ref))


def test_deep_k_follows_the_environment(monkeypatch):
    from jaxinfer.compile_cache import kernel_env

    monkeypatch.setenv("JAXINFER_FP8_DECODE_DEEP_K", "off")
    assert fp8_plan.fp8_decode_config(1, 8192, 28672, fuse="none").bk == 256
    assert kernel_env()["JAXINFER_FP8_DECODE_DEEP_K"] == "off"  # in the cache fingerprint
    monkeypatch.setenv("JAXINFER_FP8_DECODE_DEEP_K", "on")
    assert fp8_plan.fp8_decode_config(1, 8192, 28672, fuse="none").bk == 512
    monkeypatch.setenv("JAXINFER_FP8_DECODE_DEEP_K", "yes")
    with pytest.raises(api.LinearError, match="JAXINFER_FP8_DECODE_DEEP_K"):
        fp8_plan.fp8_engine_plan(1, 8192, 28672)


@pytest.mark.parametrize("M,N", [(1, 96), (13, 200)])
def test_deep_k_config_matches_the_reference(M, N):
    """The deep-K tiles (opt-in since session 14) for the 70B up projection (512 K a step,
    3 stages), run at a small shape (K = 2048: 4 steps; split 1 and 2; ragged N) with W8A8
    per-token x scales as the engine calls it: equal to the float32 reference (interpret
    mode)."""
    K = 2048
    big = fp8_plan.fp8_decode_config(M, 8192, 28672, fuse="none", deep_k=True)
    assert (big.bk, big.num_stages) == (512, 3)
    x = rand(M + N, (M, K))
    wq, ws = fp8_weight(2 * M + N, N, K)
    xq, xs = quantize_rows_fp8(x)
    ref = linear_ref(xq, wq, ws, xs, out_dtype=F32)
    for split in (1, 2):
        c = dataclasses.replace(big, split_k=split)
        out = triton_linear(xq, wq, ws, x_scale=xs, config=c, out_dtype=F32, interpret=True)
        assert out.shape == ref.shape and rel_err(out, ref) < 1e-5, (split, rel_err(out, ref))


@pytest.mark.parametrize("deep_k", [True, None])  # the opt-in and the default (off)
def test_deep_k_and_wide_configs_lower_for_cuda_at_the_70b_shapes(deep_k):
    sds = jax.ShapeDtypeStruct
    for M, K, N in [(1, 8192, 28672), (1, 28672, 8192), (1, 8192, 10240), (32, 8192, 28672),
                    (64, 8192, 28672)]:
        c = fp8_plan.fp8_decode_config(M, K, N, fuse="none", deep_k=deep_k)
        assert c.bk == (512 if deep_k else 256) if M == 1 else c.bn == (128 if M == 32 else 64)
        # the default's 256-deep steps of 64-row tiles: wgmma
        assert c.fast_accum == (c.bk == 256 and c.bn == 64)
        text = lower_for_cuda(functools.partial(triton_linear, config=c),
                              sds((M, K), FP8), sds((N, K), FP8), sds((N,), F32),
                              sds((M,), F32))
        assert "skinny_gemm" in text
