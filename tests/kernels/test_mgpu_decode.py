"""The Mosaic GPU swap-AB decode GEMM (``mgpu_gemm.mgpu_decode_linear``) on CPU.

Its first H200 run (session 4, W8A8, M = 1) died with "CUDA misaligned address": the
per-warpgroup scale slices in shared memory started at 288 / 544 bytes, and a TMA copy's
shared-memory address must be 128-byte aligned. The interpreter does not check that, so these
tests record every TMA copy's shared-memory offset while the kernel runs in the Mosaic GPU
interpreter (``tests/kernels/tma_alignment.py``) and assert the alignment, next to the usual
comparison with the float32 reference on fresh random inputs (outputs poisoned with NaN by
the interpreter, so "all finite" means all written).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.matmul import linear_ref, quantize_rows_fp8
from pallas_kernels.matmul.mgpu_gemm import decode_config, mgpu_decode_linear
from tests.kernels.cuda_lowering import lower_for_cuda
from tests.kernels.tma_alignment import TMA_SMEM_ALIGN, record_smem_copies

FP8 = jnp.float8_e4m3fn
F32 = jnp.float32


def operands(seed: int, M: int, K: int, N: int, kind: str):
    x = jax.random.normal(jax.random.key(seed), (M, K), F32).astype(jnp.bfloat16)
    w = jax.random.normal(jax.random.key(seed + 1), (N, K), F32) / np.sqrt(K)
    if kind == "bf16":
        return x, w.astype(jnp.bfloat16), None, None
    xq, xs = quantize_rows_fp8(x)
    wq, ws = quantize_rows_fp8(w)
    return xq, wq, ws, xs


def rel_err(out, ref) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert np.isfinite(out).all(), "kernel left unwritten (NaN) or non-finite outputs"
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


@pytest.mark.parametrize("kind,M,tile_m,split", [
    ("w8a8", 1, 64, 2),     # the configuration that faulted on the H200 (8 tokens per WG)
    ("w8a8", 33, 128, 1),   # 48 tokens: 24 per warpgroup, 128 weight rows
    ("w8a8", 64, 64, 1),
    ("bf16", 1, 64, 1),
    ("bf16", 20, 128, 2),
])
def test_decode_matches_reference_with_aligned_tma(kind, M, tile_m, split):
    K, N = 512, 256
    x, w, ws, xs = operands(40 + M + tile_m, M, K, N, kind)
    cfg = decode_config(M, K, N, x.dtype, split_k=split, stages=2, tile_m=tile_m)
    with record_smem_copies() as seen:
        out = mgpu_decode_linear(x, w, ws, xs, config=cfg, out_dtype=F32, interpret=True)
        out = jax.block_until_ready(out)
    assert out.shape == (M, N)
    assert rel_err(out, linear_ref(x, w, ws, xs, out_dtype=F32)) < 1e-5
    dirs = {c.direction for c in seen}
    assert dirs == {"gmem_to_smem", "smem_to_gmem"}, dirs
    if kind == "w8a8":  # both scale slices of both warpgroups went through TMA
        assert sum(c.dtype == "float32" and c.direction == "gmem_to_smem" for c in seen) >= 4
    bad = sorted({(c.direction, c.shape, c.offset_bytes) for c in seen
                  if c.offset_bytes % TMA_SMEM_ALIGN})
    assert not bad, f"TMA copies at shared-memory offsets not 128-byte aligned: {bad}"


def test_alignment_recorder_sees_a_misaligned_copy():
    """The recorder reports the offset of an unaligned slice (the pre-fix scale layout), so the
    alignment assertion above can fail."""

    def kernel(x_gmem, o_gmem):
        @functools.partial(pl.run_scoped, smem=plgpu.SMEM((2, 72), F32),
                           bar=plgpu.Barrier(num_barriers=1))
        def _(smem, bar):
            plgpu.copy_gmem_to_smem(x_gmem, smem.at[1, pl.ds(0, 64)], bar)
            plgpu.barrier_wait(bar)
            plgpu.copy_smem_to_gmem(smem.at[1, pl.ds(0, 64)], o_gmem)
            plgpu.wait_smem_to_gmem(0)

    f = plgpu.kernel(kernel, out_type=jax.ShapeDtypeStruct((64,), F32),
                     interpret=plgpu.InterpretGPUParams())
    x = jax.random.normal(jax.random.key(7), (64,), F32)
    with record_smem_copies() as seen:
        out = jax.block_until_ready(f(x))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(x))
    assert sorted(c.offset_bytes for c in seen) == [288, 288]


def test_decode_config_split_and_stages():
    # 8B o_proj / 70B o_proj, FP8, 64-row tiles: 64 tiles x 2 and 128 tiles x 1 fill one wave
    # of 132 SMs. 8B gate_up: 448 tiles are 3.4 waves (the busiest SM streams 4 units), 896
    # half-K units 6.8 (7 half units): split 2. K / s >= 512 bounds the split.
    assert decode_config(1, 4096, 4096, FP8).split_k == 2
    assert decode_config(1, 8192, 8192, FP8).split_k == 1
    assert decode_config(1, 4096, 28672, FP8).split_k == 2
    assert decode_config(1, 1024, 64, FP8).split_k == 2
    assert decode_config(1, 4096, 4096, FP8, split_k=8).split_k == 8
    for M in (1, 16, 64):
        for tm in (64, 128):
            c = decode_config(M, 8192, 8192, jnp.bfloat16, tile_m=tm, stages=12)
            per_stage = (tm + 2 * c.tile_n) * c.tile_k * 2
            assert c.max_concurrent_steps * per_stage <= 160 * 1024
            assert c.tile_n == max(16, -(-M // 16) * 16) // 2


def test_decode_rejects_n_not_multiple_of_tile_m():
    x, w, _, _ = operands(3, 1, 256, 192, "bf16")
    cfg = decode_config(1, 256, 192, x.dtype, tile_m=128)
    with pytest.raises(ValueError, match="not a multiple of 128"):
        mgpu_decode_linear(x, w, config=cfg, interpret=True)


@pytest.mark.parametrize("M,tile_m,dtype", [(1, 128, FP8), (64, 128, jnp.bfloat16),
                                             (16, 64, FP8)])
def test_decode_tiles_lower_for_cuda(M, tile_m, dtype):
    K, N = 4096, 6144
    cfg = decode_config(M, K, N, dtype, tile_m=tile_m)
    sds = jax.ShapeDtypeStruct
    scaled = dtype == FP8

    def f(x, w, ws, xs):
        return mgpu_decode_linear(x, w, ws if scaled else None, xs if scaled else None,
                                  config=cfg)

    text = lower_for_cuda(f, sds((M, K), dtype), sds((N, K), dtype), sds((N,), F32),
                          sds((M,), F32))
    assert "mosaic_gpu" in text


def test_bench_guard_child_checks_every_decode_tiling():
    """bench_matmul.py's guard (run before the H200 benchmark touches the GPU) checks each
    mgpu_decode tiling of plan_mdec; on a CPU it runs them in the interpreter."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    script = os.path.join(root, "benchmarks", "kernels", "bench_matmul.py")
    env = dict(os.environ, PYTHONPATH=root, JAX_PLATFORMS="cpu")
    p = subprocess.run([sys.executable, script, "--guard-child", "--ms", "1",
                        "--guard-shape", "256,256"], check=False, capture_output=True,
                       text=True, env=env, timeout=300)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("GUARD ")]
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert len(lines) == 3 and all(ln.endswith(" ok") for ln in lines), lines
