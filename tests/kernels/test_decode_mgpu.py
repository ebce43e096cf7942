"""decode_mgpu (Mosaic GPU paged decode attention) on CPU.

The kernel runs under the Mosaic GPU interpreter (P through shared memory and a fresh
accumulator per P V wgmma, the interpreter's limits in JAX 0.11.2; the GPU path keeps P in
registers and accumulates in place) against the jnp reference, with the conventions of
test_paged_attention.py: fresh random inputs, NaN in every cache slot the kernel must not
read (a read shows as a non-finite output), permuted pages, ragged lengths (1, page
boundaries, a full table, 0 = padding). Then it lowers for an H200 at the engine's shapes
and the GPU check's configs (smem size and wgmma operand checks happen there), and the
``fp8_variant="mgpu"`` dispatch of ``paged_decode_attention``. The GPU check and timing:
benchmarks/kernels/check_decode_mgpu.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_attention import (
    PagedAttentionUnsupportedError,
    paged_decode_attention,
    paged_decode_attention_ref,
)
from pallas_kernels.paged_attention.decode_mgpu import (
    MgpuDecodeConfig,
    mgpu_decode_supported,
    paged_decode_attention_mgpu,
)
from tests.kernels.cuda_lowering import decode_avals, lower_for_cuda
from tests.kernels.test_paged_attention import LAYER, make_case

F8 = jnp.float8_e4m3fn
SCALES = {"k_scale": jnp.float32(0.7), "v_scale": jnp.float32(1.9)}
SCALE = 128 ** -0.5


def run_both(c, *, window=0, scales=None, fn=paged_decode_attention_mgpu, **kw):
    q, kd, vd, kc, vc, bt, lens = c
    scales = scales or {}
    out = fn(q, kd, vd, jnp.int32(LAYER), bt, lens, scale=SCALE, window=window,
             interpret=True, **scales, **kw)
    ref = paged_decode_attention_ref(q, kc, vc, jnp.int32(LAYER), bt, lens, scale=SCALE,
                                     window=window, **scales)
    return np.asarray(out, np.float64), np.asarray(ref, np.float64)


def check(out, ref, bound: float) -> None:
    assert np.all(np.isfinite(out)), "non-finite output (a masked slot read, or unwritten)"
    rel = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    assert rel < bound, rel


@pytest.mark.parametrize("kv,lens,splits,q_terms,hpc,bound", [
    (F8, [1, 16, 33, 64, 128], None, 2, 1, 5e-3),  # two e4m3 terms of q: ~1.4e-3 measured
    (F8, [128, 17, 80], 2, 2, 1, 5e-3),
    (F8, [128, 17, 80], 2, 1, 1, 4e-2),  # one e4m3 term (3 mantissa bits of q): ~1.7e-2
    (F8, [1, 16, 33, 64, 128], 2, 2, 2, 5e-3),  # two KV heads a CTA
    (jnp.bfloat16, [1, 48, 128], 2, 2, 1, 5e-3),
    (jnp.bfloat16, [1, 48, 128], None, 2, 2, 5e-3),
])
def test_matches_reference(kv, lens, splits, q_terms, hpc, bound):
    c = make_case(11 + len(lens), B=len(lens), G=4, Hkv=2, D=128, ps=16, maxp=8, lens=lens,
                  kv_dtype=kv)
    cfg = MgpuDecodeConfig(num_splits=splits, q_terms=q_terms, heads_per_cta=hpc)
    out, ref = run_both(c, scales=SCALES if kv == F8 else None, config=cfg)
    check(out, ref, bound)


def test_window_traced_layer_traced_and_padding_rows():
    lens = [0, 1, 70, 128]
    c = make_case(5, B=4, G=4, Hkv=1, D=128, ps=16, maxp=8, lens=lens, kv_dtype=F8, window=40)
    out, ref = run_both(c, window=jnp.int32(40), scales=SCALES,
                        config=MgpuDecodeConfig(num_splits=2))
    check(out[1:], ref[1:], 5e-3)
    assert np.all(out[0] == 0)


def test_block_tokens_128_and_page_32():
    c = make_case(9, B=2, G=8, Hkv=1, D=128, ps=32, maxp=6, lens=[192, 40], kv_dtype=F8)
    out, ref = run_both(c, scales=SCALES, config=MgpuDecodeConfig(block_tokens=128, stages=2))
    check(out, ref, 5e-3)


def test_dispatch_from_paged_decode_attention(monkeypatch):
    """``fp8_variant="mgpu"`` (or $JAXINFER_FP8_DECODE=mgpu) runs this kernel bit for bit;
    shapes it does not take (D = 64) run the Triton kernel's by-batch default."""
    c = make_case(3, B=2, G=4, Hkv=1, D=128, ps=16, maxp=4, lens=[64, 9], kv_dtype=F8)
    direct, _ = run_both(c, scales=SCALES)
    routed, _ = run_both(c, scales=SCALES, fn=paged_decode_attention, fp8_variant="mgpu")
    np.testing.assert_array_equal(routed, direct)
    monkeypatch.setenv("JAXINFER_FP8_DECODE", "mgpu")
    env, _ = run_both(c, scales=SCALES, fn=paged_decode_attention)
    np.testing.assert_array_equal(env, direct)
    c64 = make_case(4, B=2, G=4, Hkv=1, D=64, ps=16, maxp=4, lens=[64, 9], kv_dtype=F8)
    fb, ref = run_both(c64, scales=SCALES, fn=paged_decode_attention, fp8_variant="mgpu")
    triton, _ = run_both(c64, scales=SCALES, fn=paged_decode_attention,
                         fp8_variant="by_batch")
    np.testing.assert_array_equal(fb, triton)
    check(fb, ref, 1e-2)


def test_supported_and_errors():
    assert mgpu_decode_supported((4, 32, 128), (2, 8, 9, 16, 128), F8)
    assert mgpu_decode_supported((4, 32, 128), (2, 8, 9, 16, 128), jnp.bfloat16)
    assert not mgpu_decode_supported((4, 32, 64), (2, 8, 9, 16, 64), F8)  # D
    assert not mgpu_decode_supported((4, 128, 128), (2, 8, 9, 16, 128), F8)  # G = 16
    assert not mgpu_decode_supported((4, 32, 128), (2, 8, 9, 16, 128), jnp.float16)
    assert not mgpu_decode_supported((4, 32, 128), (2, 8, 9, 128, 128), F8)  # ps > 64
    c = make_case(1, B=1, G=4, Hkv=1, D=64, ps=16, maxp=4, lens=[5], kv_dtype=F8)
    with pytest.raises(PagedAttentionUnsupportedError):
        run_both(c)
    with pytest.raises(ValueError):
        MgpuDecodeConfig(block_tokens=32)


# The engine's shapes (Llama-3.1-8B heads) and the configs the GPU check times.
SHAPES = [(32, 2048), (128, 1024), (128, 2048), (1, 32768)]
CONFIGS = [MgpuDecodeConfig(), MgpuDecodeConfig(block_tokens=64, stages=2),
           MgpuDecodeConfig(block_tokens=128, stages=2), MgpuDecodeConfig(p_smem=True),
           MgpuDecodeConfig(regs=(168, 40)), MgpuDecodeConfig(q_terms=1),
           MgpuDecodeConfig(heads_per_cta=2), MgpuDecodeConfig(heads_per_cta=2, stages=3),
           MgpuDecodeConfig(heads_per_cta=2, regs=(232, 40)),
           MgpuDecodeConfig(v_layout="WGMMA_UPCAST_2X"),
           MgpuDecodeConfig(heads_per_cta=2, v_layout="WGMMA_UPCAST_2X"),
           MgpuDecodeConfig(p_smem=True, fresh_acc=True)]  # the interpreter's code path
LOWER = ([(B, ctx, kv, 0) for B, ctx in SHAPES for kv in (F8, jnp.bfloat16)]
         + [(32, 2048, kv, i) for i in range(1, len(CONFIGS)) for kv in (F8, jnp.bfloat16)
            if kv == F8 or CONFIGS[i].heads_per_cta == 1])  # bf16 two heads: 320 KB smem


@pytest.mark.parametrize("B,ctx,kv,cfg", LOWER)
def test_lowers_for_cuda(B, ctx, kv, cfg):
    """Trace and lower for an H200 (traced layer and window): one Mosaic GPU custom call."""
    args = [*decode_avals(B, ctx // 16, kv), jax.ShapeDtypeStruct((), jnp.int32)]  # + window
    scales = {"k_scale": 0.5, "v_scale": 2.0} if kv == F8 else {}

    def fn(*a):
        return paged_decode_attention_mgpu(*a[:6], scale=SCALE, window=a[6], **scales,
                                           config=CONFIGS[cfg])
    text = lower_for_cuda(fn, *args)
    assert text.count("custom_call @mosaic_gpu") == 1


def test_gpu_check_script_smoke(tmp_path):
    """check_decode_mgpu.py's CPU mode: a child process checks a variant in the interpreter
    (poisoned slots, ragged lengths) and the parent records what it printed."""
    import json

    from benchmarks.kernels import check_decode_mgpu
    check_decode_mgpu.main(["--smoke", "--variants", "mgpu_h2_t64_s4", "--deadline-s", "600",
                            "--out", str(tmp_path)])
    recs = json.loads((tmp_path / "results_decode_mgpu.json").read_text())
    checks = [r for r in recs if r["name"].startswith("decode_mgpu/check_rel_err/")]
    assert len(checks) == len(check_decode_mgpu.SMOKE_SHAPES)
    assert all(r["config"]["ok"] and r["value"] < 5e-3 for r in checks), checks
