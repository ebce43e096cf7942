"""The engine's KV write, ``reference.write_kv_ref``: every method ("scatter", "unique",
"rows", "auto") stores exactly what a numpy loop over the tokens stores, outside the null page
(page 0, where padding tokens write and nothing reads), leaves every other slot as it was, and
takes the layer as a traced scalar under jit; ``kv_write_method`` resolves "auto" and the
int32 limit of "rows"; bench_kv_write.py's CPU mode checks and times each method and fails
when one differs."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_attention import reference as ref
from pallas_kernels.paged_attention.kv_write import kv_write_supported, write_kv_pallas

E4M3 = jnp.float8_e4m3fn
METHODS = ref.KV_WRITE_METHODS
KERNEL = "kernel"  # kv_write.write_kv_pallas in interpret mode


def _write(method: str, kc, vc, layer, k, v, slots, **scales):
    if method == KERNEL:
        return write_kv_pallas(kc, vc, layer, k, v, slots, **scales, interpret=True)
    return ref.write_kv_ref(kc, vc, layer, k, v, slots, method=method, **scales)


def _slots(rng, T: int, P: int, ps: int, padding: int) -> np.ndarray:
    """T slots: distinct ones on pages >= 1, the last ``padding`` on the null page's slot 0."""
    free = rng.permutation(np.arange(ps, P * ps))[:T]
    if padding:
        free[-padding:] = 0
    return free.astype(np.int32)


def _want(cache: np.ndarray, layer: int, x: np.ndarray, slots: np.ndarray, ps: int,
          dtype, scale) -> np.ndarray:
    """numpy: each real token's [Hkv, D] into [layer, :, page, off] (quantized like the
    engine: divided by the scale, saturated to e4m3's +-448)."""
    out = cache.copy()
    for t, s in enumerate(slots):
        if s == 0:
            continue
        v = x[t].astype(np.float32)
        if scale is not None:
            v = np.clip(v / scale, -448, 448)
        out[layer, :, s // ps, s % ps] = np.asarray(jnp.asarray(v).astype(dtype))
    return out


@pytest.mark.parametrize("method", METHODS + (KERNEL,))
@pytest.mark.parametrize("dtype", [jnp.bfloat16, E4M3, jnp.float32])
@pytest.mark.parametrize("T", [1, 5, 70])
def test_write_matches_numpy_outside_null_page(method, dtype, T):
    L, Hkv, P, ps, D = 3, 2, 40, 4, 16  # 70 tokens: more than KV_WRITE_ROWS_BELOW ("auto")
    rng = np.random.default_rng(T)
    fp8 = dtype == E4M3
    # poisoned caches: every slot holds a value the write never produces
    kc = jnp.full((L, Hkv, P, ps, D), -7, dtype)
    vc = jnp.full((L, Hkv, P, ps, D), 5, dtype)
    k = (rng.standard_normal((T, Hkv, D)) * 3).astype(np.float32)
    v = rng.standard_normal((T, Hkv, D)).astype(np.float32)
    if fp8:
        k[0, 0, :2] = [1000.0, -1000.0]  # / 2 saturates
    ks, vs = (np.float32(2.0), np.float32(0.25)) if fp8 else (None, None)
    slots = _slots(rng, T, P, ps, padding=min(2, T - 1))
    layer = 1
    write = jax.jit(lambda kc, vc, lay, k, v, s: _write(method, kc, vc, lay, k, v, s,
                                                        k_scale=ks, v_scale=vs))
    got_k, got_v = write(kc, vc, jnp.int32(layer), jnp.asarray(k, jnp.bfloat16),
                         jnp.asarray(v, jnp.bfloat16), jnp.asarray(slots))
    kb = np.asarray(jnp.asarray(k, jnp.bfloat16).astype(jnp.float32))
    vb = np.asarray(jnp.asarray(v, jnp.bfloat16).astype(jnp.float32))
    want_k = _want(np.asarray(kc), layer, kb, slots, ps, dtype, ks)
    want_v = _want(np.asarray(vc), layer, vb, slots, ps, dtype, vs)
    f32 = np.float32
    np.testing.assert_array_equal(np.asarray(got_k)[:, :, 1:].astype(f32),
                                  want_k[:, :, 1:].astype(f32))
    np.testing.assert_array_equal(np.asarray(got_v)[:, :, 1:].astype(f32),
                                  want_v[:, :, 1:].astype(f32))
    # the other layers' null pages are untouched too (only this layer's page 0 may change)
    others = [x for x in range(L) if x != layer]
    assert np.all(np.asarray(got_k)[others, :, 0].astype(f32) == -7)
    if fp8:
        assert float(np.asarray(got_k)[layer, 0, slots[0] // ps, slots[0] % ps, 0]
                     .astype(f32)) == 448.0


def test_kv_write_method_resolution(monkeypatch):
    assert ref.kv_write_method("auto", 1, 100, 8) == "rows"
    assert ref.kv_write_method("auto", ref.KV_WRITE_ROWS_BELOW - 1, 100) == "rows"
    assert ref.kv_write_method("auto", ref.KV_WRITE_ROWS_BELOW, 100) == "unique"
    assert ref.kv_write_method("rows", 1, 2**31 - 1, 2) == "rows"
    assert ref.kv_write_method("rows", 1, 2**31, 2) == "unique"  # row numbers past int32
    assert ref.kv_write_method("auto", 2, 100, 1) == "rows"
    assert ref.kv_write_method("auto", 1, 100, 1) == "unique"  # one row: see the next test
    assert ref.kv_write_method("rows", 1, 100) == "unique"
    assert ref.kv_write_method("auto", 1, 2**31) == "unique"
    assert ref.kv_write_method("scatter", 1, 2**40) == "scatter"
    monkeypatch.setattr(ref, "KV_WRITE_METHOD", "scatter")
    assert ref.kv_write_method(None, 1, 100) == "scatter"
    with pytest.raises(ValueError, match="method 'atomic' is not one of"):
        ref.kv_write_method("atomic", 1, 100)
    kc = jnp.zeros((1, 1, 2, 4, 8), jnp.bfloat16)
    x = jnp.zeros((1, 1, 8), jnp.bfloat16)
    with pytest.raises(ValueError, match="write_kv_ref: method 'bogus'"):
        ref.write_kv_ref(kc, kc, 0, x, x, jnp.zeros(1, jnp.int32), method="bogus")


@pytest.mark.parametrize("B, Hkv", [(1, 1), (2, 1), (1, 2)])
def test_write_then_decode_updates_the_pool_in_place(B, Hkv):
    """A decode step's K / V write and the attention that reads the pool, donated, compile
    without a copy of the pool. With "rows" for one token of one KV head (Gemma 3 270M's
    batch-1 decode) XLA:CPU copied the whole pool twice a layer: a step's time grew with
    the pool, not the context (a 1,024-page pool: ~450 ms a token)."""
    P, ps, D = 256, 4, 16
    kc = jnp.zeros((1, Hkv, P, ps, D), jnp.float32)

    def step(kc, vc, q, kn, vn, slots, bt, lens):
        kc, vc = ref.write_kv_ref(kc, vc, jnp.int32(0), kn, vn, slots)
        return kc, vc, ref.paged_decode_attention_ref(q, kc, vc, jnp.int32(0), bt, lens,
                                                      scale=0.25)

    args = (kc, kc, jnp.ones((B, 2 * Hkv, D)), jnp.ones((B, Hkv, D)), jnp.ones((B, Hkv, D)),
            jnp.arange(B, dtype=jnp.int32) + ps, jnp.ones((B, 4), jnp.int32),
            jnp.full((B,), ps + 1, jnp.int32))
    hlo = jax.jit(step, donate_argnums=(0, 1)).lower(*args).compile().as_text()
    pool = [line.strip()[:100] for line in hlo.splitlines()
            if " copy(" in line and (f"[1,{Hkv},{P},{ps},{D}]" in line
                                     or f"[{Hkv * P * ps},{D}]" in line)]
    assert not pool, pool


def test_bench_kv_write_cpu_smoke_checks_and_times(tmp_path):
    from benchmarks.kernels import bench_kv_write

    bench_kv_write.main(["--cpu-smoke", "--out", str(tmp_path)])
    recs = json.loads((tmp_path / "kv_write.json").read_text())
    got = {(r["config"]["method"], r["config"]["kv_dtype"]) for r in recs}
    assert got == {(m, d) for m in METHODS + (KERNEL,) for d in ("bfloat16", "float8_e4m3fn")}
    assert all(r["config"]["check_vs_scatter"] is True for r in recs)
    assert all(r["value"] > 0 and r["unit"] == "GB/s" for r in recs)


def test_bench_kv_write_check_fails_on_a_wrong_method(tmp_path, monkeypatch):
    from benchmarks.kernels import bench_kv_write

    good = ref.write_kv_ref

    def broken(kc, vc, layer, k, v, slots, method=None, **kw):  # "rows" writes V + 1
        return good(kc, vc, layer, k, v + 1 if method == "rows" else v, slots,
                    method=method, **kw)

    monkeypatch.setattr(ref, "write_kv_ref", broken)
    with pytest.raises(SystemExit, match="check"):
        bench_kv_write.main(["--cpu-smoke", "--methods", "scatter,rows", "--out",
                             str(tmp_path)])


@pytest.mark.parametrize("method", ["rows", "unique", "scatter", KERNEL])
def test_out_of_range_slots_touch_no_other_page(method):
    """A slot past the pool (a caller's bug) must not land in another layer's or head's pages
    (the flat "rows" view would put page P + 1 of head 0 into head 1): "rows" and the kernel
    send it to the null page, the scatters drop it; the real token beside it is written."""
    L, Hkv, P, ps, D = 2, 2, 5, 4, 16
    kc = jnp.zeros((L, Hkv, P, ps, D), jnp.float32)
    x = jnp.ones((2, Hkv, D), jnp.float32)
    slots = jnp.asarray([P * ps + 5, 2 * ps + 1], jnp.int32)  # out of range, then page 2 off 1
    got, _ = _write(method, kc, kc, 0, x, x, slots)
    got = np.asarray(got)
    want = np.zeros((L, Hkv, P, ps, D), np.float32)
    want[0, :, 2, 1] = 1.0
    np.testing.assert_array_equal(got[:, :, 1:], want[:, :, 1:])
    assert not got[1].any()  # the other layer, null page included


def test_kernel_refuses_bad_input():
    kc = jnp.zeros((1, 2, 3, 4, 16), jnp.bfloat16)
    x = jnp.zeros((2, 2, 16), jnp.bfloat16)
    s = jnp.zeros(2, jnp.int32)
    with pytest.raises(ValueError, match=r"must be \[2, 2, 16\]"):
        write_kv_pallas(kc, kc, 0, x[:, :1], x, s, interpret=True)
    with pytest.raises(ValueError, match="caches differ"):
        write_kv_pallas(kc, kc.astype(jnp.float32), 0, x, x, s, interpret=True)
    kc12 = jnp.zeros((1, 2, 3, 4, 12), jnp.bfloat16)
    with pytest.raises(ValueError, match="head dim 12"):
        write_kv_pallas(kc12, kc12, 0, x[..., :12], x[..., :12], s, interpret=True)
    assert [kv_write_supported(d) for d in (8, 16, 64, 96, 128, 256)] == [
        False, True, True, False, True, True]
    with pytest.raises(ValueError, match="layer 1 is outside the cache's 1 layers"):
        write_kv_pallas(kc, kc, 1, x, x, s, interpret=True)
    with pytest.raises(ValueError, match="1-D integer array"):
        write_kv_pallas(kc, kc, 0, x, x, s[:, None], interpret=True)
    with pytest.raises(ValueError, match="1-D integer array"):
        write_kv_pallas(kc, kc, 0, x, x, s.astype(jnp.float32), interpret=True)
    with pytest.raises(ValueError, match=r"\[L, Hkv, P, ps, D\]"):
        write_kv_pallas(kc[0], kc[0], 0, x, x, s, interpret=True)


def test_kernel_writes_nothing_for_no_tokens():
    kc = jnp.full((1, 2, 3, 4, 16), 7, jnp.bfloat16)
    x = jnp.zeros((0, 2, 16), jnp.bfloat16)
    got = write_kv_pallas(kc, kc, 0, x, x, jnp.zeros(0, jnp.int32), interpret=True)
    assert all(bool((g == 7).all()) for g in got)


@pytest.mark.parametrize("dtype,scales", [(jnp.bfloat16, False), (E4M3, True)])
@pytest.mark.parametrize("T,Hkv,D", [(1, 8, 128), (64, 8, 128), (32, 1, 256), (8, 3, 64)])
def test_kernel_lowers_for_an_h200(dtype, scales, T, Hkv, D):
    """Engine shapes (8B at 1 / 64 tokens, Gemma 3 270M, SmolLM2) over a pool past 2^32 bytes
    (Pallas' Triton lowering then indexes with 64-bit offsets)."""
    from tests.kernels.cuda_lowering import lower_for_cuda

    sds = jax.ShapeDtypeStruct
    pool = sds((32, Hkv, 36000 * 8 // Hkv, 16, D), dtype)
    args = [pool, pool, sds((), jnp.int32), sds((T, Hkv, D), jnp.bfloat16),
            sds((T, Hkv, D), jnp.bfloat16), sds((T,), jnp.int32)]
    args += [sds((), jnp.float32)] * 2 if scales else []
    text = lower_for_cuda(write_kv_pallas, *args)
    assert "kv_write" in text and "__gpu$xla.gpu.triton" in text
    assert "output_operand_aliases" in text


@pytest.mark.parametrize("kernel", [False, True])
def test_engine_write_on_the_kernel_equals_the_scatter(kernel, monkeypatch):
    """PallasAttentionBackend.write with KV_WRITE_KERNEL on (interpret) stores what the
    base class's scatter stores; off, it is the scatter."""
    from jaxinfer.layers import pallas_attention as pa

    monkeypatch.setattr(pa, "KV_WRITE_KERNEL", kernel)
    calls = []
    real = pa.write_kv_pallas
    monkeypatch.setattr(pa, "write_kv_pallas", lambda *a, **k: calls.append(1) or real(*a, **k))
    rng = np.random.default_rng(3)
    kc = jnp.asarray(rng.standard_normal((2, 2, 6, 4, 16)), E4M3)
    k = jnp.asarray(rng.standard_normal((3, 2, 16)) * 600, jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((3, 2, 16)), jnp.bfloat16)
    slots = jnp.asarray([5, 17, 0], jnp.int32)
    sc = dict(k_scale=jnp.float32(2.0), v_scale=jnp.float32(0.5))
    got = pa.PallasAttentionBackend(interpret=True).write(kc, kc, 1, k, v, slots, **sc)
    want = ref.write_kv_ref(kc, kc, 1, k, v, slots, **sc)
    assert len(calls) == int(kernel)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g[:, :, 1:].astype(jnp.float32)),
                                      np.asarray(w[:, :, 1:].astype(jnp.float32)))
