"""prefill_mgpu (Mosaic GPU varlen prefill attention) on CPU: the plan (gather, per-row and
per-tile KV ranges) emulated in jnp equals the reference, and the kernel lowers for an H200.
The kernel itself runs only on a Hopper GPU (bench_prefill_mgpu.py checks it there)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.kernels.bench_paged_prefill import make_case
from benchmarks.kernels.kernel_bench import rel_err
from pallas_kernels.paged_attention import paged_prefill_attention_ref
from pallas_kernels.paged_attention.prefill_mgpu import (
    MgpuPrefillConfig,
    paged_prefill_attention_mgpu,
    plan,
)
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
