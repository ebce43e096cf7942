"""Decode-kernel layouts and FP8 variants vs the jnp reference (interpret mode on CPU).

Covers the transposed ``layout="kq"`` (8 or 16 group rows), the staged FP8 V
(``fp8_v_stage``), every named entry of ``fp8.FP8_DECODE_VARIANTS`` and every config of the
GPU sweep (benchmarks/kernels/bench_paged_fp8_sweep.py), with the conventions of
test_paged_attention.py: fresh random inputs, NaN in every cache slot the kernel must not
read, permuted pages, ragged lengths (1, page boundaries, a full table). Launch options
(warps, stages) do not change the interpreter's result; the CUDA lowering test covers them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.kernels.bench_paged_fp8_sweep import CONFIGS, main, parse_shapes
from pallas_kernels.paged_attention import paged_decode_attention, paged_decode_attention_ref
from pallas_kernels.paged_attention.fp8 import FP8_DECODE_VARIANTS
from tests.kernels.cuda_lowering import decode_avals, lower_paged_kernel
from tests.kernels.test_paged_attention import LAYER, assert_close, make_case, run_both

F8 = jnp.float8_e4m3fn
SCALES = {"k_scale": jnp.float32(0.7), "v_scale": jnp.float32(1.9)}
LENS = [1, 16, 33, 64, 128]  # 1, a page, past a page, 4 pages, the full 8-page table


def case(seed: int, G: int, D: int, kv=F8, ps: int = 16, maxp: int = 8, Hkv: int = 1):
    lens = [min(n, ps * maxp) for n in LENS]
    return make_case(seed, B=len(lens), G=G, Hkv=Hkv, D=D, ps=ps, maxp=maxp, lens=lens,
                     kv_dtype=kv)


def assert_same(a, b) -> None:
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.parametrize("G,D,rows,bt,splits", [
    (4, 128, 8, 128, None), (4, 64, 8, 32, 3), (1, 64, 8, 16, 2), (8, 128, 8, 64, 1),
    (16, 64, 8, 32, 2), (4, 64, 16, 64, 2), (2, 256, 16, 128, None),
])
def test_kq_layout_f32_exact(G, D, rows, bt, splits):
    """Transposed scores on f32 caches: the same numbers as the reference to 1e-4."""
    c = case(G * D + bt, G, D, kv=jnp.float32, Hkv=2)
    out, ref = run_both(c, layout="kq", group_rows=rows, block_tokens=bt, num_splits=splits)
    assert_close(out, ref, tight=True)


@pytest.mark.parametrize("G,D,rows,bt,splits", [
    (4, 128, 8, 128, None), (1, 64, 8, 32, 3), (8, 64, 16, 32, 1),
])
def test_kq_layout_fp8_and_staged_v(G, D, rows, bt, splits):
    """FP8 ``kq``: matches the reference; the staged V (a multiply by a 1/0 mask) changes no
    bit; bit-placement widening equals ``cvt`` bit for bit, as in the ``qk`` layout."""
    c = case(100 + G * D + bt, G, D)
    kw = dict(layout="kq", group_rows=rows, block_tokens=bt, num_splits=splits, **SCALES)
    staged, ref = run_both(c, fp8_v_stage=True, **kw)
    plain, _ = run_both(c, fp8_v_stage=False, **kw)
    bits, _ = run_both(c, fp8_v_stage=True, fp8_widen="bits", **kw)
    assert_close(staged, ref, tight=False)
    assert_same(staged, plain)
    assert_same(bits, staged)


@pytest.mark.parametrize("bt,splits", [(128, None), (32, 3)])
def test_qk_layout_staged_v_changes_no_bit(bt, splits):
    c = case(7 + bt, 4, 128)
    kw = dict(block_tokens=bt, num_splits=splits, **SCALES)
    staged, ref = run_both(c, fp8_v_stage=True, **kw)
    plain, _ = run_both(c, **kw)
    assert_close(staged, ref, tight=False)
    assert_same(staged, plain)


@pytest.mark.parametrize("window", [5, 40])
def test_kq_window_traced_layer_traced_and_padding_rows(window):
    lens = [0, 1, 17, 64, 0]
    c = make_case(window, B=5, G=4, Hkv=2, D=64, ps=16, maxp=4, lens=lens, window=window,
                  kv_dtype=F8)
    q, kd, vd, kc, vc, bt, ln = c
    f = jax.jit(functools.partial(paged_decode_attention, scale=0.2, interpret=True,
                                  fp8_variant="kq8_bt64", num_splits=2, **SCALES))
    out = f(q, kd, vd, jnp.int32(LAYER), bt, ln, window=jnp.int32(window))
    ref = paged_decode_attention_ref(q, kc, vc, jnp.int32(LAYER), bt, ln, scale=0.2,
                                     window=window, **SCALES)
    assert_close(out, ref, tight=False)
    assert np.all(np.asarray(out)[[0, 4]] == 0)


@pytest.mark.parametrize("name", list(FP8_DECODE_VARIANTS))
def test_every_named_variant(name):
    """Each table entry by name (``fp8_variant``), as the engine would run it."""
    c = case(300 + len(name), 4, 128)
    out, ref = run_both(c, scale=128 ** -0.5, fp8_variant=name, **SCALES)
    assert_variant_close(out, ref, FP8_DECODE_VARIANTS[name])


@pytest.mark.parametrize("name", ["kq8", "kq8_bt64_w2_tp512", "kq8_bt64_w2_waves", "cvt"])
@pytest.mark.parametrize("ps", [32, 64])
def test_fp8_variants_at_large_pages(name, ps):
    """The by-batch FP8 variants (and cvt) at 32- and 64-token pages: a step of one page,
    of two, or of less than one page's tokens raised to the page; lengths 1, inside the first
    page, a page boundary and the full table (LENS capped at the table)."""
    c = case(600 + ps + len(name), 4, 128, ps=ps, maxp=128 // ps)  # LENS end at 128
    out, ref = run_both(c, scale=128 ** -0.5, fp8_variant=name, **SCALES)
    assert_variant_close(out, ref, FP8_DECODE_VARIANTS[name])


def assert_variant_close(out, ref, kw: dict) -> None:
    """The widening variants within assert_close's bound; those with FP8 dots (q / p in
    e4m3) within a bound of their own (test_paged_attention.py)."""
    if kw.get("fp8_dots", "none") != "none":
        o, r = np.asarray(out, np.float64), np.asarray(ref, np.float64)
        assert np.all(np.isfinite(o)) and np.linalg.norm(o - r) / np.linalg.norm(r) < 4e-2
    else:
        assert_close(out, ref, tight=False)


def _semantic_configs() -> dict[str, dict]:
    """Sweep configs less those differing only in warps / stages (same interpreter run)."""
    seen: dict[tuple, str] = {}
    for name, kw, _ in CONFIGS:
        key = tuple(sorted((k, v) for k, v in kw.items() if k not in ("num_warps",
                                                                       "num_stages")))
        seen.setdefault(key, name)
    return {n: kw for n, kw, _ in CONFIGS if n in seen.values()}


@pytest.mark.parametrize("name,kw", list(_semantic_configs().items()),
                         ids=list(_semantic_configs()))
def test_every_sweep_config(name, kw):
    kw = dict(kw)
    kv = F8 if kw.pop("kv") == "fp8" else jnp.bfloat16
    c = case(400 + len(name), 4, 128, kv=kv)
    out, ref = run_both(c, scale=128 ** -0.5, **(SCALES if kv == F8 else {}), **kw)
    assert_variant_close(out, ref, kw)


@pytest.mark.parametrize("name,kw", [(n, kw) for n, kw, _ in CONFIGS],
                         ids=[n for n, _, _ in CONFIGS])
def test_sweep_configs_lower_for_cuda(name, kw):
    """Each sweep config traces and lowers for an H200 at the sweep's B32 ctx2048 shape."""
    kw = dict(kw)
    kv = F8 if kw.pop("kv") == "fp8" else jnp.bfloat16
    args = decode_avals(32, 128, kv)
    text = lower_paged_kernel(paged_decode_attention, args, kv, "traced", **kw)
    assert text.count("xla.gpu.triton") == 1


@pytest.mark.parametrize("name", list(FP8_DECODE_VARIANTS))
def test_named_variants_lower_for_cuda(name):
    """Each table entry traces and lowers for an H200 (B32 ctx2048, Llama-3.1-8B heads)."""
    args = decode_avals(32, 128, F8)
    text = lower_paged_kernel(paged_decode_attention, args, F8, "traced", fp8_variant=name)
    assert text.count("xla.gpu.triton") == 1


def test_option_errors():
    q, kd, vd, _, _, bt, lens = case(1, 4, 64)
    call = functools.partial(paged_decode_attention, q, kd, vd, 1, bt, lens, scale=1.0,
                             interpret=True)
    with pytest.raises(ValueError, match="layout"):
        call(layout="vk")
    with pytest.raises(ValueError, match="group_rows"):
        call(layout="qk", group_rows=8)
    with pytest.raises(ValueError, match="group_rows"):
        call(layout="kq", group_rows=12)
    with pytest.raises(ValueError, match="fp8_dots"):
        call(layout="kq", fp8_dots="k")
    with pytest.raises(ValueError, match="unknown FP8 decode variant"):
        call(fp8_variant="nope")


def test_variant_fills_only_unset_options(monkeypatch):
    """A variant supplies the options the caller leaves None; explicit ones win. The table
    default applies to FP8 caches only."""
    from pallas_kernels.paged_attention.fp8 import ENV_VARIANT
    c = case(500, 4, 64)
    a, _ = run_both(c, fp8_variant="kq8", block_tokens=32, **SCALES)
    b, _ = run_both(c, layout="kq", group_rows=8, fp8_v_stage=True, block_tokens=32, **SCALES)
    assert_same(a, b)
    monkeypatch.setenv(ENV_VARIANT, "nope")  # a bf16 cache never reads the table
    c16 = case(501, 4, 64, kv=jnp.bfloat16)
    out, ref = run_both(c16, block_tokens=32)
    assert_close(out, ref, tight=False)


def test_default_fp8_variant_follows_the_batch(monkeypatch):
    """FP8_DECODE_DEFAULT "by_batch": the H200 sweeps' fastest variant at the nearest measured
    batch (1-3 -> kq8, 4-15 -> kq8_bt64_w2 split to ~4 programs an SM, 16+ -> kq8_bt64_w2
    split by wave efficiency);
    $JAXINFER_FP8_DECODE still overrides."""
    from pallas_kernels.paged_attention import fp8

    monkeypatch.delenv(fp8.ENV_VARIANT, raising=False)
    assert fp8.FP8_DECODE_DEFAULT == "by_batch"
    got = {b: fp8.variant_for_batch(b) for b in (1, 3, 4, 8, 16, 32, 63, 64, 128, 256)}
    mid, waves = "kq8_bt64_w2_tp512", "kq8_bt64_w2_waves"
    assert got == {1: "kq8", 3: "kq8", 4: mid, 8: mid, 16: waves, 32: waves, 63: waves,
                   64: waves, 128: waves, 256: waves}
    assert fp8.fp8_decode_config(None, 8)["target_programs"] == 512
    assert fp8.fp8_decode_config(None, 128)["wave_slots"] == 4 * 132
    assert fp8.fp8_decode_config(None, 1) == fp8.FP8_DECODE_VARIANTS["kq8"]
    assert fp8.fp8_decode_config("cvt", 128) == {}
    monkeypatch.setenv(fp8.ENV_VARIANT, "cvt")
    assert fp8.fp8_decode_config(None, 128) == {}
    assert fp8.fp8_decode_config(None, 128, 1, 256) == {}


@pytest.mark.parametrize("batch,kv_heads,want", [
    (1, 8, "kq8"), (3, 8, "kq8"), (4, 8, "kq8_bt32_w2_tp512"), (15, 8, "kq8_bt32_w2_tp512"),
    (16, 8, "kq8_bt32_w2_waves"), (64, 8, "kq8_bt32_w2_waves"),
    (4, 1, "kq8"), (16, 1, "kq8"), (31, 1, "kq8"), (32, 1, "kq8_bt32_w2_waves"),
    (8, 4, "kq8_bt32_w2_tp512"), (4, 4, "kq8")])
def test_default_fp8_variant_at_head_dim_256(monkeypatch, batch, kv_heads, want):
    """Head dim 256 (Gemma 3): kq8 below 32 (row, KV head) groups, else the batch table's
    variant at 32-token steps; head dims below 256 keep the table."""
    from pallas_kernels.paged_attention import fp8

    monkeypatch.delenv(fp8.ENV_VARIANT, raising=False)
    assert fp8.variant_for_batch(batch, kv_heads, 256) == want
    assert fp8.fp8_decode_config(None, batch, kv_heads, 256) == fp8.FP8_DECODE_VARIANTS[want]
    for d in (None, 64, 128):
        assert fp8.variant_for_batch(batch, kv_heads, d) == fp8.variant_for_batch(batch)


@pytest.mark.parametrize("kv_heads,want_tokens", [(1, 128), (8, 32)])
def test_default_fp8_at_head_dim_256_matches_reference(monkeypatch, kv_heads, want_tokens):
    """The default FP8 launch at D 256 as the engine runs it (no options): 5 rows x 1 KV head
    take kq8 (128-token steps), x 8 KV heads the 32-token variant; both against the
    reference (poisoned slots, permuted pages, ragged lengths)."""
    from pallas_kernels.paged_attention import fp8

    monkeypatch.delenv(fp8.ENV_VARIANT, raising=False)
    c = case(700 + kv_heads, 1, 256, Hkv=kv_heads)
    assert fp8.fp8_decode_config(None, 5, kv_heads, 256)["block_tokens"] == want_tokens
    out, ref = run_both(c, scale=256 ** -0.5, **SCALES)
    assert_close(out, ref, tight=False)


def test_num_stages_follow_the_grid():
    """bf16 / f16 at D 64 / 128: 5 stages (two K/V buffers) while the grid fits three programs
    an SM, 4 (one buffer, more programs an SM) past it; FP8 and other head dims (256: measured
    no gain) keep 5; a caller's num_stages wins. launch_grid applies it to the split grid it
    computes."""
    from pallas_kernels.paged_attention import decode_options as do

    lim = do.RESIDENT_TWO_BUFFERS * do.NUM_SMS_H200
    assert do.default_num_stages(jnp.bfloat16, 128, lim) == 5
    assert do.default_num_stages(jnp.bfloat16, 128, lim + 1) == 4
    assert do.default_num_stages(jnp.float16, 128, 1024) == 4
    assert do.default_num_stages(jnp.float8_e4m3fn, 128, 1024) == 5
    assert do.default_num_stages(jnp.bfloat16, 64, 1024) == 4
    assert do.default_num_stages(jnp.bfloat16, 64, lim) == 5
    assert do.default_num_stages(jnp.bfloat16, 256, 1024) == 5
    o = do._resolve_options(jnp.bfloat16, None, 128, block_tokens=None, num_splits=None,
                            target_programs=None, num_warps=None, num_stages=None,
                            fp8_widen=None, fp8_dots=None, layout=None, group_rows=None,
                            fp8_v_stage=None, unroll=None)
    # B128 ctx1024, 8 KV heads: 1024 programs of one split -> 4 stages; B32: 256 -> 5
    assert do.launch_grid(o, jnp.bfloat16, 128, 8, 64, 16, 128) == (64, 4, 1, 64, 4)
    assert do.launch_grid(o, jnp.bfloat16, 32, 8, 64, 16, 128)[-1] == 5
    assert do.launch_grid(dict(o, num_stages=3), jnp.bfloat16, 128, 8, 64, 16, 128)[-1] == 3


@pytest.mark.parametrize("batch,kv_heads,warps,tokens", [
    (1, 1, 8, None), (7, 1, 8, None), (8, 1, 4, None), (1, 8, 4, None), (15, 1, 4, None),
    (16, 1, 4, 32), (2, 8, 4, 32), (4, 8, 4, 32), (16, 8, 4, 32), (128, 1, 4, 32),
    (17, 8, 4, None), (64, 8, 4, None)])
def test_16bit_options_at_head_dim_256(batch, kv_heads, warps, tokens):
    """16-bit caches at D 256 (Gemma 3): 8 warps below 8 (row, KV head) groups, 32-token
    steps from 16 groups while the grid splits (SPLIT_MAX_GROUPS), the defaults elsewhere;
    a caller's options win; D 128 and FP8 are not touched by this rule."""
    from pallas_kernels.paged_attention import decode_options as do

    unset = dict.fromkeys(("block_tokens", "num_splits", "target_programs", "num_warps",
                           "num_stages", "fp8_widen", "fp8_dots", "layout", "group_rows",
                           "fp8_v_stage", "unroll", "wave_slots"))
    def launch(kv, D, **opts):  # (warps, tokens a step) of a 2048-token table, page 16
        o = do._resolve_options(kv, None, batch, kv_heads, D, **opts)
        return o["num_warps"], do.launch_grid(o, kv, batch, kv_heads, 128, 16, D)[0]

    assert launch(jnp.bfloat16, 256, **unset) == (warps, tokens or 64)
    assert launch(jnp.bfloat16, 128, **unset) == (4, 64)
    assert launch(jnp.float8_e4m3fn, 256, **unset)[0] in (2, 4)  # the FP8 table's, not 8
    mine = dict(unset, num_warps=2, block_tokens=128)
    assert launch(jnp.float16, 256, **mine) == (2, 128)


@pytest.mark.parametrize("kv_heads", [1, 4])
def test_bf16_default_at_head_dim_256_matches_reference(kv_heads):
    """The default bf16 launch at D 256 (5 rows: 5 groups at 8 warps, 20 groups at 32-token
    steps) against the reference (poisoned slots, permuted pages, ragged lengths)."""
    c = case(800 + kv_heads, 2, 256, kv=jnp.bfloat16, Hkv=kv_heads)
    out, ref = run_both(c, scale=256 ** -0.5)
    assert_close(out, ref, tight=False)


@pytest.mark.parametrize("kv", [F8, jnp.bfloat16])
def test_default_at_smollm2_heads_matches_reference(kv):
    """SmolLM2's geometry (9 q heads over 3 KV heads: a group of 3, padded; D 64) through the
    default launch of each cache dtype, against the reference."""
    c = case(900 + jnp.dtype(kv).itemsize, 3, 64, kv=kv, Hkv=3)
    out, ref = run_both(c, scale=64 ** -0.5, **(SCALES if kv == F8 else {}))
    assert_close(out, ref, tight=False)


def test_sweep_shapes_option():
    """bench_paged_fp8_sweep --shapes: BxCTX entries; a malformed one stops the run before
    any work, naming the entry."""
    assert parse_shapes("512x1536, 128x2048") == [(512, 1536), (128, 2048)]
    for bad in ("512", "512x", "0x16", "2x3x4", "ax16", "-1x16"):
        with pytest.raises(ValueError, match="is not BxCTX"):
            parse_shapes(bad)
    with pytest.raises(SystemExit):
        main(["--smoke", "--no-preflight", "--shapes", "512x"])
