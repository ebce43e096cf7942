"""FP8 dots on wgmma from Pallas-Triton (pallas_kernels/matmul/fp8_fast_accum.py) and the
decode plan's use of them (fp8_plan.FP8_DECODE_FAST_ACCUM): the Triton IR the kernel hands
to XLA carries ``maxNumImpreciseAcc = 128`` on exactly the FP8 dots that ask for it (the
attribute Triton needs to lower an e4m3 dot to wgmma), the kernel with it still matches the
float32 reference in interpret mode, and the plan takes it where the H200 measured it
faster."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.matmul import fp8_fast_accum, fp8_plan
from pallas_kernels.matmul.reference import gate_up_ref, linear_ref, quantize_rows_fp8
from pallas_kernels.matmul.triton_gemm import TritonConfig, triton_linear
from tests.kernels.cuda_lowering import (
    decode_avals,
    lower_for_cuda,
    lower_paged_kernel,
    triton_ir,
)
from tests.kernels.test_matmul import F32, FP8, rand, rel_err
from tests.kernels.test_matmul_fused import fp8_weight

sds = jax.ShapeDtypeStruct


def gemm_ir(cfg: TritonConfig, M: int, K: int, N: int, x_dtype=FP8) -> str:
    """The Triton IR (text) Pallas emits for ``triton_linear`` at these abstract shapes."""
    x_scale = sds((M,), F32) if x_dtype == FP8 else None
    fn = functools.partial(triton_linear, config=cfg)
    with triton_ir() as seen:
        lower_for_cuda(lambda x, w, ws, xs: fn(x, w, ws, x_scale=xs),
                       sds((M, K), x_dtype), sds((N, K), FP8), sds((N,), F32), x_scale)
    assert len(seen) == 1
    return seen[0]


def dot_lines(ir: str) -> list[str]:
    return [ln for ln in ir.splitlines() if "tt.dot " in ln]


@pytest.mark.parametrize("M", [1, 64])
def test_fast_accum_marks_only_its_fp8_dot(M):
    base = fp8_plan.fp8_decode_config(M, 4096, 6144, fuse="none", tiles="wave15")
    fast = dot_lines(gemm_ir(dataclasses.replace(base, fast_accum=True), M, 4096, 6144))
    plain = dot_lines(gemm_ir(dataclasses.replace(base, fast_accum=False), M, 4096, 6144))
    assert len(fast) == len(plain) == 1
    assert "f8E4M3FN" in fast[0] and f"maxNumImpreciseAcc = {fp8_fast_accum.PROMOTE_EVERY}" \
        in fast[0], fast[0]
    assert "maxNumImpreciseAcc" not in plain[0]
    # a bf16 dot (W8A16: the FP8 weight widened) asks for nothing, fast_accum or not
    w8a16 = TritonConfig(bm=16, bn=64, bk=256, split_k=1, fast_accum=True)
    lines = dot_lines(gemm_ir(w8a16, 16, 1024, 256, x_dtype=jnp.bfloat16))
    assert lines and all("maxNumImpreciseAcc" not in ln and "bf16" in ln for ln in lines)


@pytest.mark.parametrize("M,N,gate_up", [(1, 200, False), (16, 96, True), (64, 300, False)])
def test_fast_accum_configs_match_the_reference(M, N, gate_up):
    """The plan's fast-accumulation tiles at small ragged shapes (interpret mode has no FP8
    tensor cores: it accumulates exactly, so this checks the kernel around the dot)."""
    K = 1024
    cfg = fp8_plan.fp8_decode_config(M, K, N, gate_up, fuse="none", tiles="wave15")
    assert cfg.fast_accum and cfg.bk == 256, cfg
    x = rand(M + N, (M, K))
    wq, ws = fp8_weight(5 * M + N, 2 * N if gate_up else N, K)
    xq, xs = quantize_rows_fp8(x)
    ref = (gate_up_ref if gate_up else linear_ref)(xq, wq, ws, xs, out_dtype=F32)
    for split in (1, 2):
        c = dataclasses.replace(cfg, split_k=split)
        out = triton_linear(xq, wq, ws, x_scale=xs, gate_up=gate_up, config=c,
                            out_dtype=F32, interpret=True)
        assert out.shape == ref.shape and rel_err(out, ref) < 1e-5, (split, rel_err(out, ref))


def test_plan_takes_fast_accum_where_the_h200_measured_it_faster(monkeypatch):
    """Session 13, call 4: faster on 256-deep K steps with 64-row tiles (3 stages) and on
    128-row tiles at 64 tokens (2 stages) — since session 31 the wide weights take 64-row
    tiles in 3 stages at 64 tokens (faster still); slower on the 512-deep steps (deep K,
    opt-in) and on 128-row tiles at 32 tokens, which keep mma.sync. Off with $JAXINFER_FP8_DECODE_FAST_ACCUM=off, with
    session 12's tiles, and with in-kernel activation groups."""
    cfg = functools.partial(fp8_plan.fp8_decode_config, fuse="none", tiles="wave15")
    for (M, K, N, gu), (fast, stages) in {
            (1, 4096, 6144, False): (True, 3), (16, 4096, 14336, True): (True, 3),
            (32, 14336, 4096, False): (True, 3), (64, 8192, 8192, False): (True, 3),
            (64, 4096, 28672, False): (True, 3), (64, 8192, 28672, False): (True, 3),
            (1, 8192, 28672, False): (True, 3), (16, 14336, 4096, False): (True, 3),
            (32, 8192, 28672, False): (False, 3)}.items():
        c = cfg(M, K, N, gu)
        assert (c.fast_accum, c.num_stages) == (fast, stages), (M, K, N, gu, c)
    # the opt-in 512-deep steps (deep K, off by default since session 14) keep mma.sync
    for M, K, N in [(1, 8192, 28672), (16, 14336, 4096)]:
        c = cfg(M, K, N, deep_k=True)
        assert (c.bk, c.fast_accum, c.num_stages) == (512, False, 3), (M, K, N, c)
    assert not fp8_plan.fp8_decode_config(1, 4096, 6144, fuse="none", tiles="wave2").fast_accum
    assert not fp8_plan.fp8_decode_config(1, 4096, 6144, fuse="all").fast_accum
    from jaxinfer.compile_cache import kernel_env

    monkeypatch.setenv("JAXINFER_FP8_DECODE_FAST_ACCUM", "off")
    assert not cfg(1, 4096, 6144).fast_accum and cfg(1, 4096, 6144).num_stages == 4
    assert kernel_env()["JAXINFER_FP8_DECODE_FAST_ACCUM"] == "off"
    monkeypatch.setenv("JAXINFER_FP8_DECODE_FAST_ACCUM", "yes")
    with pytest.raises(ValueError, match="JAXINFER_FP8_DECODE_FAST_ACCUM"):
        fp8_plan.fp8_engine_plan(1, 4096, 6144)


@pytest.mark.parametrize("name", ["kq8w_bt64", "kq8w"])
def test_paged_decode_wgmma_variants_mark_both_fp8_dots(name):
    """fp8.FP8_DECODE_VARIANTS' kq8w*: the transposed layout's two dots (K q8ᵀ and Vᵀ P8)
    are FP8 and ask for wgmma; the widening variant kq8 asks for nothing."""
    from pallas_kernels.paged_attention import paged_decode_attention

    def dots(variant):
        with triton_ir() as seen:
            lower_paged_kernel(paged_decode_attention, decode_avals(32, 128, FP8), FP8, 0,
                               fp8_variant=variant)
        return dot_lines(seen[0])

    fast = dots(name)
    assert len(fast) == 2 and all("f8E4M3FN" in ln and "maxNumImpreciseAcc = 128" in ln
                                  for ln in fast), fast
    assert not any("maxNumImpreciseAcc" in ln for ln in dots("kq8"))


@pytest.mark.parametrize("name", ["kq8k_bt64", "kq8k"])
def test_paged_decode_kq8k_variants_mark_only_the_scores_dot(name):
    """fp8.FP8_DECODE_VARIANTS' kq8k*: K q8ᵀ is FP8 and asks for wgmma; P V takes the widened
    (f16) V and asks for nothing."""
    from pallas_kernels.paged_attention import paged_decode_attention

    with triton_ir() as seen:
        lower_paged_kernel(paged_decode_attention, decode_avals(32, 128, FP8), FP8, 0,
                           fp8_variant=name)
    lines = dot_lines(seen[0])
    assert len(lines) == 2, lines
    fast = [ln for ln in lines if "maxNumImpreciseAcc = 128" in ln]
    assert len(fast) == 1 and "f8E4M3FN" in fast[0], lines
    assert "f8E4M3FN" not in [ln for ln in lines if ln not in fast][0], lines
