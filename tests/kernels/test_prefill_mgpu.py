"""prefill_mgpu (Mosaic GPU varlen prefill attention) on CPU: the plan (gather, per-row and
per-tile KV ranges) emulated in jnp equals the reference, and the kernel lowers for an H200;
the pallas_mgpu backend's static per-bucket routing (Triton below MGPU_MIN_TOKENS, no cond
where the bucket cannot overflow the buffer) and one kernel lowering per shape in a program.
The kernel itself runs only on a Hopper GPU (bench_prefill_mgpu.py checks it there)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels.paged_attention.prefill_mgpu_route as R
from benchmarks.kernels.bench_paged_prefill import make_case
from benchmarks.kernels.kernel_bench import rel_err
from pallas_kernels.paged_attention import paged_prefill_attention_ref
from pallas_kernels.paged_attention.prefill_mgpu import (
    MgpuPrefillConfig,
    paged_prefill_attention_mgpu,
    plan,
)
from pallas_kernels.paged_attention.prefill_mgpu_route import mgpu_route, worst_case_context
from tests.kernels.cuda_lowering import lower_for_cuda

CASES = {
    "ragged_chunked_pad": ([(0, 1), (0, 16), (40, 37), (0, 69), (64, 61)], 11, 0),
    "window": ([(0, 200), (30, 90)], 5, 48),
    "one_seq": ([(0, 256)], 0, 0),
}


def emulate(c: dict, cfg: MgpuPrefillConfig, window: int, kv_capacity: int):
    """What the kernel computes from the plan, in jnp; also checks the tile ranges."""
    kb, vb, rows, tiles, pairs, fits = plan(c["kc"], c["vc"], 1, c["bt"], c["lens"],
                                            c["pos"], c["sid"], window,
                                            kv_capacity=kv_capacity, cfg=cfg)
    T, Hq, _ = c["q"].shape
    G = Hq // kb.shape[1]
    Tq = rows.shape[1]
    q = jnp.pad(c["q"], ((0, Tq - T), (0, 0), (0, 0))).astype(jnp.float32)
    k = jnp.repeat(kb.astype(jnp.float32), G, axis=1)
    v = jnp.repeat(vb.astype(jnp.float32), G, axis=1)
    j = np.arange(kb.shape[0])
    vis = (j[None] >= np.asarray(rows[0])[:, None]) & (j[None] <= np.asarray(rows[1])[:, None])
    real = np.asarray(rows[0] <= rows[1])
    bq, bkv = cfg.block_q, cfg.block_kv
    tl, pr = np.asarray(tiles).reshape(-1, 4), np.asarray(pairs).reshape(-1, 2)
    for t in range(Tq // bq):
        blk, rr = vis[t * bq:(t + 1) * bq], real[t * bq:(t + 1) * bq]
        lo, flo, fhi, hi = tl[t]
        plo, phi = pr[t // 2]
        assert plo <= lo <= flo <= fhi <= hi <= phi
        steps = np.nonzero(blk.reshape(bq, -1, bkv).any(axis=(0, 2)))[0]
        assert all(lo <= s < hi for s in steps), (t, steps, tl[t])
        for s in range(flo, fhi):
            assert blk[rr][:, s * bkv:(s + 1) * bkv].all(), (t, s)
    s = jnp.einsum("thd,khd->htk", q, k) * c["scale"]
    p = jax.nn.softmax(jnp.where(jnp.asarray(vis)[None], s, -jnp.inf), axis=-1)
    o = jnp.einsum("htk,khd->thd", jnp.where(jnp.isnan(p), 0, p), v)[:T]
    return jnp.where((c["sid"] >= 0)[:, None, None], o, 0), bool(fits)


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("cfg", [MgpuPrefillConfig(64, 64, 2), MgpuPrefillConfig(64, 128, 2)])
def test_plan_matches_reference(name, cfg):
    seqs, pad, window = CASES[name]
    c = make_case(seqs, Hq=4, Hkv=2, D=64, pad=pad)
    c["scale"] = 0.125
    r = paged_prefill_attention_ref(c["q"], c["kc"], c["vc"], jnp.int32(1), c["bt"], c["lens"],
                                    c["pos"], c["sid"], scale=0.125, window=window)
    o, fits = emulate(c, cfg, window, kv_capacity=sum(a + b for a, b in seqs))
    assert fits
    assert rel_err(o, r) < 1e-2
    assert np.all(np.asarray(o)[np.asarray(c["sid"]) < 0] == 0)


def test_plan_reports_overflow():
    c = make_case([(100, 50)], Hq=4, Hkv=2, D=64)
    *_, fits = plan(c["kc"], c["vc"], 0, c["bt"], c["lens"], c["pos"], c["sid"], 0,
                    kv_capacity=100, cfg=MgpuPrefillConfig())
    assert not bool(fits)


@pytest.mark.parametrize("cfg", [MgpuPrefillConfig(64, 128, 2), MgpuPrefillConfig(64, 64, 4),
                                 MgpuPrefillConfig(128, 64, 2)])
@pytest.mark.parametrize("fallback", [False, True])
def test_lowers_for_cuda(cfg, fallback):
    sds = jax.ShapeDtypeStruct
    T, S = 1000, 3

    def f(q, kc, vc, bt, lens, pos, sid, window):
        return paged_prefill_attention_mgpu(q, kc, vc, jnp.int32(0), bt, lens, pos, sid,
                                            scale=0.088, window=window, config=cfg,
                                            fallback=fallback)
    kv = sds((2, 8, 300, 16, 128), jnp.bfloat16)
    i32 = jnp.int32
    text = lower_for_cuda(f, sds((T, 32, 128), jnp.bfloat16), kv, kv, sds((S, 100), i32),
                          sds((S,), i32), sds((T,), i32), sds((T,), i32), sds((), i32))
    assert "mosaic_gpu" in text


def test_backend_selectable():
    from jaxinfer.layers.attention import get_backend
    assert get_backend("pallas_mgpu").name == "pallas_mgpu"
    assert get_backend("pallas").name == "pallas"


def test_auto_picks_mgpu_on_hopper_only(monkeypatch):
    """"auto": pallas_mgpu on compute capability 9.x, pallas on other GPUs, else reference."""
    import jaxinfer.layers.attention as A

    assert A.resolve_backend_name("pallas") == "pallas"
    monkeypatch.setattr(A.jax, "default_backend", lambda: "cpu")
    assert A.resolve_backend_name("auto") == "reference"
    monkeypatch.setattr(A.jax, "default_backend", lambda: "gpu")
    for cc, want in (("9.0", "pallas_mgpu"), ("8.0", "pallas"), ("10.0", "pallas")):
        dev = type("Dev", (), {"compute_capability": cc})()
        monkeypatch.setattr(A.jax, "devices", lambda dev=dev: [dev])
        assert A.resolve_backend_name("auto") == want, cc


TRITON = "__gpu$xla.gpu.triton"


def test_route():
    assert R.MGPU_MIN_TOKENS == 2048
    # worst case: min(S, T) rows of maxp * page_size tokens
    assert worst_case_context(4096, 64, 272, 16) == 64 * 4352
    assert worst_case_context(8, 64, 4, 16) == 8 * 64
    assert mgpu_route(512, 1, 272, 16) == "triton"  # below the threshold
    assert mgpu_route(1024, 64, 272, 16) == "triton"  # below the threshold
    assert mgpu_route(4096, 1, 272, 16) == "mgpu"  # 4352 <= 2 T: cannot overflow
    assert mgpu_route(4096, 64, 272, 16) == "mgpu_cond"  # the engine's Pallas buckets
    kw = {"min_tokens": 1024}
    assert mgpu_route(1024, 1, 272, 16, **kw) == "mgpu_cond"  # a 4352-token context > 2048
    assert mgpu_route(1024, 64, 272, 16, **kw) == "mgpu_cond"
    assert mgpu_route(1024, 64, 272, 16, overflow="triton", **kw) == "triton"
    assert mgpu_route(256, 2, 16, 16, min_tokens=256) == "mgpu"


def _lower(window=0, **kw):
    sds = jax.ShapeDtypeStruct
    T, S, maxp = 1024, 2, 64
    i32 = jnp.int32

    def f(q, kc, vc, bt, lens, pos, sid):
        return paged_prefill_attention_mgpu(q, kc, vc, 0, bt, lens, pos, sid, scale=0.125,
                                            window=window, **kw)
    kv = sds((1, 2, 300, 16, 128), jnp.bfloat16)
    return lower_for_cuda(f, sds((T, 8, 128), jnp.bfloat16), kv, kv, sds((S, maxp), i32),
                          sds((S,), i32), sds((T,), i32), sds((T,), i32))


def test_no_cond_where_the_bucket_cannot_overflow():
    """2 rows of 64 pages: at most 2048 context tokens, the default 2 T buffer holds them:
    no lax.cond (a host sync per layer on XLA:GPU), no Triton fallback in the program."""
    text = _lower()
    assert "mosaic_gpu" in text
    assert "stablehlo.case" not in text and TRITON not in text
    # a smaller explicit buffer can overflow: the cond and the Triton fallback are back
    text = _lower(kv_capacity=1024)
    assert "stablehlo.case" in text and TRITON in text


def _program_text(monkeypatch, layers: int, T: int, S: int, maxp: int) -> str:
    import jaxinfer.layers.attention as A
    from jaxinfer.batch import Bucket
    from jaxinfer.compile import abstract_runner
    from jaxinfer.config import EngineConfig
    from jaxinfer.layers.pallas_attention import PallasAttentionBackend
    from tests.conftest import tiny_config

    # off a GPU get_backend picks interpret mode (no Mosaic kernel): lower as on the H200
    monkeypatch.setattr(A, "get_backend", lambda name: PallasAttentionBackend(
        interpret=False, prefill_mgpu=name == "pallas_mgpu"))
    ec = EngineConfig(max_model_len=maxp * 16, block_size=16, max_num_seqs=4, num_kv_pages=64,
                      max_num_batched_tokens=T, prefill_buckets=(T,), decode_buckets=(4,),
                      max_prefill_seqs=S, attention_backend="pallas_mgpu", dtype="bfloat16")
    cfg = tiny_config("llama", hidden_size=256, intermediate_size=512, num_heads=4,
                      num_kv_heads=2, head_dim=64, num_layers=layers,
                      max_position_embeddings=4096)
    runner = abstract_runner(cfg, ec)
    args = runner.abstract_args(Bucket("prefill", T, S, maxp))
    return lower_for_cuda(lambda *a: runner._jitted["sample"](*a), *args)


def test_program_routes_by_bucket_and_lowers_each_kernel_once(monkeypatch):
    """pallas_mgpu: a bucket below MGPU_MIN_TOKENS holds the Triton prefill kernel only, one
    at or above it the Mosaic kernel (and no cond where it cannot overflow); the kernel bodies
    in the H200 program do not grow with depth (one lowering per shape, not per layer)."""
    monkeypatch.setattr(R, "MGPU_MIN_TOKENS", 256)  # small buckets keep the test quick
    small = _program_text(monkeypatch, 2, 128, 2, 4)
    assert "mosaic_gpu" not in small and TRITON in small
    counts = {}
    for layers in (2, 4):
        text = _program_text(monkeypatch, layers, 256, 2, 4)  # 2 x 64 tokens <= 2 T
        assert TRITON not in text and "stablehlo.case" not in text
        counts[layers] = text.count("mosaic_gpu")
    assert counts[2] > 0 and counts[4] == counts[2]
    # a bucket that can overflow (2 rows of 512 tokens > 2 T) keeps the cond to Triton,
    # both kernels lowered once
    texts = {layers: _program_text(monkeypatch, layers, 256, 2, 32) for layers in (2, 4)}
    for t in texts.values():
        assert "mosaic_gpu" in t and TRITON in t and "stablehlo.case" in t
    assert texts[4].count(TRITON) == texts[2].count(TRITON)
    assert texts[4].count("mosaic_gpu") == texts[2].count("mosaic_gpu")
    monkeypatch.setattr(R, "MGPU_OVERFLOW", "triton")
    text = _program_text(monkeypatch, 2, 256, 2, 32)
    assert "mosaic_gpu" not in text and TRITON in text


@pytest.mark.parametrize("D,dtype", [(320, jnp.bfloat16), (96, jnp.bfloat16),
                                     (128, jnp.float8_e4m3fn)])
def test_kernel_refuses_what_the_route_refuses(D, dtype):
    """varlen_attention refuses (by name) every head dim / dtype that
    paged_prefill_mgpu_supported answers False for, before any lowering."""
    from pallas_kernels.paged_attention.prefill_mgpu import varlen_attention

    assert not R.paged_prefill_mgpu_supported((256, 4, D), (1, 2, 64, 16, D), dtype)
    q, kv = jnp.zeros((256, 4, D), dtype), jnp.zeros((256, 2, D), dtype)
    z = jnp.zeros((2, 256), jnp.int32)
    with pytest.raises(ValueError, match=rf"D % 64 == 0, D <= 256, got .* D={D}"):
        varlen_attention(q, kv, kv, z, z, z, scale=1.0, cfg=MgpuPrefillConfig())
