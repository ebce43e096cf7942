"""Pallas paged prefill attention vs the jnp reference (interpret mode on CPU).

Every input is fresh random data: ragged packings of several sequences (length 1, a page
boundary, several pages), chunked prefill (a sequence whose earlier pages are already in the
cache, so its positions start past 0), padding tokens, permuted block tables. Cache slots
the kernel must not read (tokens past a sequence's length, block-table entries past its
last page, tokens before the sliding window of its first query, the other layer of the
stacked cache) hold NaN in the kernel's input and zeros in the reference's, so a read of
any of them, or an unwritten output, fails the finiteness check. A last group lowers the
kernel for CUDA on this CPU machine to catch what the interpreter does not check.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_attention import (
    PagedAttentionShapeError,
    PagedAttentionUnsupportedError,
    paged_prefill_attention,
    paged_prefill_attention_ref,
    paged_prefill_attention_supported,
)
from pallas_kernels.paged_attention.prefill import block_metadata
from tests.kernels.cuda_lowering import lower_paged_kernel

LAYER = 1


def make_case(seed: int, *, seqs: list[tuple[int, int]], G: int, Hkv: int, D: int, ps: int,
              maxp: int, kv_dtype=jnp.float32, window: int = 0, pad: int = 3,
              shuffle: bool = False, spare_rows: int = 1, L: int = 2,
              all_layers: bool = False) -> dict:
    """seqs: (cached tokens, new tokens) per sequence. Returns the kernel's and the
    reference's inputs (caches with NaN / zeros in every slot the kernel must not read;
    only layer LAYER is readable unless all_layers)."""
    rng = np.random.default_rng(seed)
    S = len(seqs) + spare_rows  # spare rows: unused block-table rows (seq_len 0)
    P = S * maxp + 2
    k = rng.standard_normal((L, Hkv, P, ps, D)).astype(np.float32)
    v = rng.standard_normal((L, Hkv, P, ps, D)).astype(np.float32)
    bt = rng.permutation(np.arange(1, P))[: S * maxp].reshape(S, maxp).astype(np.int32)
    lens = np.zeros(S, np.int32)
    readable = np.zeros((L, P, ps), bool)
    pos, sid = [], []
    for s, (cached, new) in enumerate(seqs):
        n = cached + new
        assert n <= maxp * ps
        lens[s] = n
        first = max(cached - window + 1, 0) if window > 0 else 0
        for p in range(first, n):
            readable[:, bt[s, p // ps], p % ps] = True
        pos += list(range(cached, n))
        sid += [s] * new
    if not all_layers:
        readable[np.arange(L) != LAYER] = False
    pos += [0] * pad
    sid += [-1] * pad
    pos, sid = np.asarray(pos, np.int32), np.asarray(sid, np.int32)
    if shuffle:  # any token order (the kernel then meets several sequences per block)
        perm = rng.permutation(len(pos))
        pos, sid = pos[perm], sid[perm]
    T = len(pos)
    q = rng.standard_normal((T, G * Hkv, D)).astype(np.float32)
    mask = np.broadcast_to(readable[:, None, :, :, None], k.shape)
    kd, vd = np.where(mask, k, np.nan), np.where(mask, v, np.nan)
    kc, vc = np.where(mask, k, 0.0), np.where(mask, v, 0.0)
    if kv_dtype == jnp.float8_e4m3fn:  # stored = value / scale
        kd, vd, kc, vc = kd / 0.5, vd / 2.0, kc / 0.5, vc / 2.0
    cast = lambda x: jnp.asarray(x, kv_dtype)
    qdt = jnp.float32 if kv_dtype == jnp.float32 else jnp.bfloat16
    return {"q": jnp.asarray(q, qdt), "kd": cast(kd), "vd": cast(vd), "kc": cast(kc),
            "vc": cast(vc), "bt": jnp.asarray(bt), "lens": jnp.asarray(lens),
            "pos": jnp.asarray(pos), "sid": jnp.asarray(sid)}


def run_both(c: dict, *, scale: float = 0.3, window=0, **kw):
    scales = {k: v for k, v in kw.items() if k in ("k_scale", "v_scale")}
    f = jax.jit(functools.partial(paged_prefill_attention, scale=scale, window=window,
                                  interpret=True, **kw))
    out = f(c["q"], c["kd"], c["vd"], jnp.int32(LAYER), c["bt"], c["lens"], c["pos"], c["sid"])
    ref = paged_prefill_attention_ref(c["q"], c["kc"], c["vc"], jnp.int32(LAYER), c["bt"],
                                      c["lens"], c["pos"], c["sid"], scale=scale,
                                      window=window, **scales)
    return out, ref


def assert_close(out, ref, c: dict, tight: bool) -> None:
    out = np.asarray(out, np.float64)
    ref = np.asarray(ref, np.float64)
    assert out.shape == ref.shape
    assert np.all(np.isfinite(out)), "non-finite output (unwritten, or a masked slot read)"
    assert np.all(out[np.asarray(c["sid"]) < 0] == 0), "padding tokens must give zeros"
    if tight:
        np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4)
    else:
        rel = np.linalg.norm(out - ref) / np.linalg.norm(ref)
        assert rel < 1e-2, rel
        np.testing.assert_allclose(out, ref, atol=6e-2)


def ragged(ps: int) -> list[tuple[int, int]]:
    """Length 1; exactly one page; a chunk after a cached prefix; several pages."""
    return [(0, 1), (0, ps), (ps + 3, ps + 2), (0, 2 * ps + 5)]


@pytest.mark.parametrize("G,D,ps,dtype,block_m,block_k", [
    (1, 64, 16, jnp.float32, 32, 16),
    (4, 128, 16, jnp.float32, 32, 32),
    (8, 64, 32, jnp.bfloat16, 64, 32),
    (4, 256, 16, jnp.bfloat16, 32, 16),
])
def test_matches_reference(G, D, ps, dtype, block_m, block_k):
    c = make_case(G * D + ps, seqs=ragged(ps), G=G, Hkv=2, D=D, ps=ps, maxp=4, kv_dtype=dtype)
    out, ref = run_both(c, block_m=block_m, block_k=block_k)
    assert out.dtype == c["q"].dtype
    assert_close(out, ref, c, tight=dtype == jnp.float32)


def test_several_sequences_per_query_block():
    """Shuffled token order with padding in between: blocks hold up to 8 sequences."""
    seqs = [(0, 3), (5, 4), (0, 17), (20, 2), (0, 1), (31, 9)]
    c = make_case(3, seqs=seqs, G=2, Hkv=2, D=64, ps=16, maxp=3, pad=5, shuffle=True)
    out, ref = run_both(c, block_m=16, block_k=16)
    assert_close(out, ref, c, tight=True)


@pytest.mark.parametrize("window", [1, 7])
def test_sliding_window_static(window):
    seqs = [(0, 1), (0, 20), (9, 14), (30, 18)]
    c = make_case(window, seqs=seqs, G=2, Hkv=1, D=64, ps=16, maxp=4, window=window)
    out, ref = run_both(c, window=window, block_m=16, block_k=16)
    assert_close(out, ref, c, tight=True)


def test_sliding_window_and_layer_traced_inside_scan():
    """The engine's use: lax.scan over layers of the stacked cache, the window a traced
    per-layer scalar (Gemma 3 alternates sliding and global layers)."""
    windows = [0, 6, 19]
    c = make_case(5, seqs=[(0, 9), (20, 13)], G=4, Hkv=2, D=64, ps=16, maxp=3, L=3,
                  all_layers=True)  # layer 0 (no window) reads every written slot

    def body(_, lw):
        layer, w = lw
        return None, paged_prefill_attention(c["q"], c["kd"], c["vd"], layer, c["bt"],
                                             c["lens"], c["pos"], c["sid"], scale=0.2,
                                             window=w, interpret=True, block_m=32,
                                             block_k=16)
    xs = (jnp.arange(3, dtype=jnp.int32), jnp.asarray(windows, jnp.int32))
    _, outs = jax.jit(lambda: jax.lax.scan(body, None, xs))()
    for layer, w in enumerate(windows):
        ref = paged_prefill_attention_ref(c["q"], c["kc"], c["vc"], jnp.int32(layer),
                                          c["bt"], c["lens"], c["pos"], c["sid"], scale=0.2,
                                          window=w)
        assert_close(outs[layer], ref, c, tight=True)


def test_fp8_kv_with_scales():
    c = make_case(7, seqs=ragged(16), G=4, Hkv=2, D=128, ps=16, maxp=4,
                  kv_dtype=jnp.float8_e4m3fn)
    out, ref = run_both(c, k_scale=jnp.float32(0.5), v_scale=jnp.float32(2.0), block_m=32,
                        block_k=32)
    assert_close(out, ref, c, tight=False)


def test_only_padding_gives_zeros():
    c = make_case(9, seqs=[], G=2, Hkv=2, D=64, ps=16, maxp=2, pad=6)
    out, ref = run_both(c, block_m=16, block_k=16)
    assert np.all(np.asarray(out) == 0) and np.all(np.asarray(ref) == 0)


def _metadata_brute_force(pos, sid, lens, window, bq, bk):
    """Per block: {seq: (lo_tok, hi_tok, fb_lo, fb_hi)} by direct enumeration."""
    out = []
    for b in range(-(-len(pos) // bq)):
        rows = range(b * bq, min((b + 1) * bq, len(pos)))
        seqs = sorted({int(sid[t]) for t in rows if sid[t] >= 0})
        d = {}
        for s in seqs:
            ps_ = [int(pos[t]) for t in rows if sid[t] == s]
            seen = [{k for k in range(lens[s]) if k <= p and (window <= 0 or p - k < window)}
                    for p in ps_]
            union = set().union(*seen)
            full = set.intersection(*seen)
            full_blocks = [kb for kb in range(-(-int(lens[s]) // bk))
                           if all(k in full for k in range(kb * bk, (kb + 1) * bk))]
            if len(seqs) > 1 or not full_blocks:
                fb = None
            else:
                fb = (full_blocks[0], full_blocks[-1] + 1)
                assert full_blocks == list(range(*fb))
            d[s] = (min(union), max(union) + 1, fb)
        out.append(d)
    return out


@pytest.mark.parametrize("seed", range(4))
def test_block_metadata(seed):
    """The per-block ranges the kernel loops over, against a brute-force enumeration."""
    rng = np.random.default_rng(seed)
    S, bq, bk = 5, 8, 4
    lens = rng.integers(1, 40, S)
    pos, sid = [], []
    for s in range(S):
        new = int(rng.integers(1, lens[s] + 1))
        pos += list(range(lens[s] - new, lens[s]))
        sid += [s] * new
    pos, sid = np.asarray(pos + [0] * 3), np.asarray(sid + [-1] * 3)
    if seed % 2:
        perm = rng.permutation(len(pos))
        pos, sid = pos[perm], sid[perm]
    window = [0, 3, 9, 100][seed]
    nseq, meta = block_metadata(jnp.asarray(pos, jnp.int32), jnp.asarray(sid, jnp.int32),
                                jnp.asarray(lens, jnp.int32), window, bq=bq, block_k=bk,
                                max_seqs=S)
    nseq, meta = np.asarray(nseq), np.asarray(meta)
    for b, want in enumerate(_metadata_brute_force(pos, sid, lens, window, bq, bk)):
        assert nseq[b] == len(want)
        for j in range(nseq[b]):
            s, lo, hi, fb_lo, fb_hi = meta[b, j]
            assert s in want
            w_lo, w_hi, w_fb = want[s]
            assert (lo, hi) == (w_lo, w_hi)
            assert lo // bk <= fb_lo <= fb_hi <= -(-hi // bk)
            assert (None if fb_lo == fb_hi else (fb_lo, fb_hi)) == w_fb


def test_bad_inputs_raise():
    c = make_case(1, seqs=[(0, 3)], G=2, Hkv=2, D=64, ps=16, maxp=2)
    a = (c["q"], c["kd"], c["vd"], 1, c["bt"], c["lens"], c["pos"], c["sid"])
    with pytest.raises(PagedAttentionShapeError, match="positions"):
        paged_prefill_attention(*a[:6], c["pos"][:2], c["sid"], scale=1.0, interpret=True)
    with pytest.raises(PagedAttentionShapeError, match="seq_ids must be int32"):
        paged_prefill_attention(*a[:7], c["sid"].astype(jnp.int16), scale=1.0,
                                interpret=True)
    with pytest.raises(PagedAttentionShapeError, match="head dim"):
        paged_prefill_attention(c["q"][:, :, :32], *a[1:], scale=1.0, interpret=True)
    with pytest.raises(PagedAttentionShapeError, match="seq_lens"):
        paged_prefill_attention(*a[:5], c["lens"][:1], *a[6:], scale=1.0, interpret=True)
    with pytest.raises(PagedAttentionUnsupportedError, match="powers of two"):
        paged_prefill_attention(*a, scale=1.0, interpret=True, block_m=48)
    with pytest.raises(PagedAttentionUnsupportedError, match="scale"):
        paged_prefill_attention(*a, scale=-1.0, interpret=True)


def test_supported():
    ok = paged_prefill_attention_supported
    assert ok((64, 32, 128), (2, 8, 10, 16, 128), jnp.bfloat16)
    assert ok((64, 8, 256), (2, 4, 10, 32, 256), jnp.float8_e4m3fn)
    assert ok((64, 28, 128), (2, 4, 10, 16, 128), jnp.bfloat16)  # G = 7
    assert not ok((64, 32, 96), (2, 8, 10, 16, 96), jnp.bfloat16)
    assert not ok((64, 30, 128), (2, 8, 10, 16, 128), jnp.bfloat16)
    assert not ok((64, 32, 128), (2, 8, 10, 12, 128), jnp.bfloat16)
    assert not ok((64, 32, 128), (2, 8, 10, 16, 128), jnp.int8)
    assert not ok((64, 32, 128), (2, 8, 10, 16, 128), jnp.float32)


def test_pallas_backend_prefill_uses_kernel():
    """jaxinfer's Pallas backend dispatches prefill to the kernel (interpret on CPU)."""
    from jaxinfer.layers.attention import AttentionBackend, AttentionMetadata
    from jaxinfer.layers.pallas_attention import PallasAttentionBackend

    c = make_case(11, seqs=[(0, 5), (16, 7)], G=2, Hkv=2, D=64, ps=16, maxp=3)
    T = c["q"].shape[0]
    md = AttentionMetadata(positions=c["pos"], slot_mapping=jnp.zeros(T, jnp.int32),
                           seq_ids=c["sid"], block_tables=c["bt"], seq_lens=c["lens"],
                           logits_indices=jnp.zeros(3, jnp.int32), is_prefill=True)
    args = (c["q"], c["kd"], c["vd"], jnp.int32(LAYER), md, 0.25, jnp.int32(0))
    out = jax.jit(PallasAttentionBackend(interpret=True).prefill, static_argnums=5)(*args)
    ref = AttentionBackend().prefill(c["q"], c["kc"], c["vc"], jnp.int32(LAYER), md, 0.25,
                                     jnp.int32(0))
    assert_close(out, ref, c, tight=True)




@pytest.mark.parametrize("T,S,Hq,Hkv,D,ps,maxp,kv_dtype,window,kw", [
    (4096, 1, 32, 8, 128, 16, 256, jnp.bfloat16, 0, {}),
    (4096, 8, 32, 8, 128, 16, 32, jnp.bfloat16, "traced", {}),
    (2048, 4, 32, 8, 128, 16, 64, jnp.float8_e4m3fn, 0, {}),
    (1024, 4, 8, 4, 256, 32, 32, jnp.bfloat16, 512, {}),
    (1024, 4, 16, 16, 64, 16, 64, jnp.bfloat16, 0, {}),
    (512, 2, 28, 4, 128, 16, 32, jnp.bfloat16, 0, {"block_k": 128, "num_stages": 2}),
])
def test_lowers_for_cuda(T, S, Hq, Hkv, D, ps, maxp, kv_dtype, window, kw):
    """Trace and lower for an H200 on this CPU machine (no GPU needed)."""
    L, P = 2, S * maxp + 1
    sds = jax.ShapeDtypeStruct
    i32 = jnp.int32
    args = [sds((T, Hq, D), jnp.bfloat16), sds((L, Hkv, P, ps, D), kv_dtype),
            sds((L, Hkv, P, ps, D), kv_dtype), sds((), i32), sds((S, maxp), i32),
            sds((S,), i32), sds((T,), i32), sds((T,), i32)]
    text = lower_paged_kernel(paged_prefill_attention, args, kv_dtype, window, **kw)
    assert text.count("xla.gpu.triton") == 1
