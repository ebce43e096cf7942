"""Split-K decode with the merge in the kernel (``merge="kernel"``, decode_merge.py) vs the jnp
reference and vs the XLA merge (interpret mode on CPU).

Conventions of test_paged_attention.py: fresh random inputs, NaN in every cache slot the
kernel must not read, permuted pages, ragged lengths (1, page boundaries, a full table).
The interpreter starts every output (the final one and the f32 partial scratch) as NaN, so
an unwritten output element, or a merge that reads a partial no split wrote, fails the
finiteness check.

What the interpreter cannot check: it runs the grid's programs one after another, so the
last program of a group is always the last to arrive, no two atomics ever race and the
CTA barriers are skipped (it has none). These tests check the bookkeeping (every split
counts once, exactly one program merges, the counters come back zero) and the merge math;
``_ARRIVAL_STRIDE`` permutes which split arrives last. The memory ordering on a GPU is
checked by the CUDA lowering below (one launch, the counters aliased) and, on the device,
by benchmarks/kernels/bench_paged_small_batch.py (against the reference, and bit-identical
outputs over repeated runs).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_attention import (
    PagedAttentionShapeError,
    decode_merge,
    paged_decode_attention,
    paged_decode_attention_ref,
)
from tests.kernels.cuda_lowering import decode_avals, lower_paged_kernel
from tests.kernels.test_paged_attention import (
    LAYER,
    assert_close,
    make_case,
    run_both,
    scan_case,
)

F8 = jnp.float8_e4m3fn
SCALES = {"k_scale": jnp.float32(0.7), "v_scale": jnp.float32(1.9)}
LENS = [1, 16, 33, 64, 128]  # 1, a page, past a page, 4 pages, the full 8-page table


def case(seed: int, G: int, D: int, kv=jnp.float32, Hkv: int = 2, lens=LENS, window=0):
    return make_case(seed, B=len(lens), G=G, Hkv=Hkv, D=D, ps=16, maxp=8, lens=lens,
                     kv_dtype=kv, window=window)


def assert_same(a, b) -> None:
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.parametrize("G,D,kv,splits,bt", [
    (1, 64, jnp.float32, 3, 16),     # MHA, uneven splits (3 pages each, the last 2)
    (4, 64, jnp.float32, 8, 16),     # GQA 4, a page a split: short rows leave splits empty
    (4, 128, jnp.bfloat16, 2, 32),
    (3, 64, jnp.bfloat16, 4, 16),    # a group that is not a power of two
    (4, 64, F8, 4, 32),              # FP8 default variant at B = 5 (kq8: layout "kq")
    (1, 64, F8, None, 16),           # FP8, the default variant and split count (8)
])
def test_matches_reference_and_xla_merge(G, D, kv, splits, bt):
    c = case(10 * G + D + (splits or 0), G, D, kv)
    kw = dict(block_tokens=bt, num_splits=splits, **(SCALES if kv == F8 else {}))
    out, ref = run_both(c, merge="kernel", **kw)
    xla, _ = run_both(c, merge="xla", **kw)
    assert out.dtype == c[0].dtype
    assert_close(out, ref, tight=kv == jnp.float32)
    # same partials, same merge math; only the f32 summation order may differ
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(xla, np.float32),
                               rtol=1e-5 if kv == jnp.float32 else 1e-2, atol=1e-5)


@pytest.mark.parametrize("splits,stride", [(8, 3), (3, 2)])
def test_any_split_may_arrive_last(monkeypatch, splits, stride):
    """Program p computes split (p * stride) % S, so the merging program is not split S - 1:
    the output is bit for bit the in-order one (the merge reads the splits in index order
    whoever runs it)."""
    c = case(20 + splits, 4, 64)
    kw = {"block_tokens": 16, "num_splits": splits, "merge": "kernel"}
    plain, ref = run_both(c, **kw)
    monkeypatch.setattr(decode_merge, "_ARRIVAL_STRIDE", stride)
    permuted, _ = run_both(c, **kw)
    assert_close(permuted, ref, tight=True)
    assert_same(permuted, plain)
    monkeypatch.setattr(decode_merge, "_ARRIVAL_STRIDE", 2 * splits)  # the hook is read here
    with pytest.raises(ValueError, match="coprime"):
        run_both(c, **kw)


def test_merge_loop_path_and_auto_avoids_it(monkeypatch):
    """More than MERGE_MAX_UNROLLED_CHUNKS chunks of partials: the merging program adds them
    in a fori_loop (forced here by a small chunk) and still matches the reference and the
    XLA merge; merge="auto" keeps such shapes on the XLA merge (the loop has not run on a
    GPU)."""
    monkeypatch.delenv("JAXINFER_DECODE_MERGE", raising=False)
    c = case(31, 4, 64, lens=[1, 40, 128])
    kw = {"block_tokens": 16, "num_splits": 8}
    monkeypatch.setattr(decode_merge, "MERGE_CHUNK_ELEMS", 4 * 64)  # 1 split a chunk: 8 chunks
    assert not decode_merge.merge_unrolled(8, 4, 64)
    looped, ref = run_both(c, merge="kernel", **kw)
    xla, _ = run_both(c, merge="xla", **kw)
    assert_close(looped, ref, tight=True)
    assert_close(looped, xla, tight=True)
    assert decode_merge.resolve_merge("auto", 1, 2, 8, 4, 64) == "xla"
    monkeypatch.setattr(decode_merge, "MERGE_CHUNK_ELEMS", 8192)
    assert decode_merge.resolve_merge("auto", 1, 2, 8, 4, 64) == "kernel"
    # the 8B heads at B 1, ctx 32k (64 splits, G 4, D 128: 4 chunks) stay straight-line; G 8
    # (a Qwen2.5-7B-like 32 / 4 layout) at 64 splits does not
    assert decode_merge.merge_unrolled(64, 4, 128) and not decode_merge.merge_unrolled(64, 8, 128)


def test_window_traced_layer_jit_and_padding_rows():
    lens = [0, 1, 17, 128, 0]
    c = case(5, 4, 64, kv=jnp.bfloat16, lens=lens, window=40)
    q, kd, vd, kc, vc, bt, ln = c
    f = jax.jit(functools.partial(paged_decode_attention, scale=0.2, interpret=True,
                                  block_tokens=16, num_splits=4, merge="kernel"))
    out = f(q, kd, vd, jnp.int32(LAYER), bt, ln, window=jnp.int32(40))
    ref = paged_decode_attention_ref(q, kc, vc, jnp.int32(LAYER), bt, ln, scale=0.2,
                                     window=40)
    assert_close(out, ref, tight=False)
    assert np.all(np.asarray(out)[[0, 4]] == 0)


def test_counters_carried_through_a_scan():
    """The engine's use: counters carried through a scan over layers (zeros in, zeros out),
    so no zeroing runs per layer; every layer matches the reference."""
    q, kc, vc, bt, lens, L = scan_case()
    B, Hkv = q.shape[0], kc.shape[1]

    def body(ctr, layer):
        out, ctr = paged_decode_attention(q, kc, vc, layer, bt, lens, scale=0.1,
                                          interpret=True, block_tokens=16, num_splits=4,
                                          merge="kernel", merge_counters=ctr)
        return ctr, out
    ctr, outs = jax.jit(lambda: jax.lax.scan(body, jnp.zeros((B, Hkv), jnp.int32),
                                             jnp.arange(L, dtype=jnp.int32)))()
    assert np.all(np.asarray(ctr) == 0)
    for layer in range(L):
        ref = paged_decode_attention_ref(q, kc, vc, jnp.int32(layer), bt, lens, scale=0.1)
        assert_close(outs[layer], ref, tight=True)


def test_one_split_is_the_default_kernel():
    """Nothing to merge: the single-split kernel, the counters handed back untouched."""
    c = case(7, 4, 64)
    ctr = jnp.zeros((len(LENS), 2), jnp.int32)
    (out, ctr_out), ref = run_both(c, num_splits=1, merge="kernel", merge_counters=ctr)
    base, _ = run_both(c, num_splits=1)
    assert_same(out, base)
    assert ctr_out is ctr
    assert_close(out, ref, tight=True)


def test_options_checked():
    q, kd, vd, _, _, bt, lens = case(1, 4, 64)
    call = functools.partial(paged_decode_attention, q, kd, vd, 1, bt, lens, scale=1.0,
                             interpret=True)
    with pytest.raises(ValueError, match="merge="):
        call(merge="atomic")
    with pytest.raises(ValueError, match="needs merge='kernel'"):
        call(merge_counters=jnp.zeros((len(LENS), 2), jnp.int32))
    with pytest.raises(PagedAttentionShapeError, match="merge_counters"):
        call(merge="kernel", merge_counters=jnp.zeros((len(LENS), 3), jnp.int32))
    with pytest.raises(PagedAttentionShapeError, match="merge_counters"):
        call(merge="kernel", merge_counters=jnp.zeros((len(LENS), 2), jnp.float32))


def test_auto_merge_by_groups_and_env(monkeypatch):
    """merge="auto" (the default): in the kernel for B * Hkv <= MERGE_KERNEL_MAX_GROUPS (batch
    1-16 with 8 KV heads, measured faster on the H200), in XLA above; $JAXINFER_DECODE_MERGE
    overrides; lowered for an H200 the default call has one Triton launch at B = 1."""
    monkeypatch.delenv("JAXINFER_DECODE_MERGE", raising=False)
    assert decode_merge.MERGE_KERNEL_MAX_GROUPS == 128
    r = functools.partial(decode_merge.resolve_merge, splits=32, group=4, head_dim=128)
    assert r("auto", 1, 8) == "kernel"
    assert r("auto", 2, 8) == "kernel"
    assert r("auto", 8, 8) == "kernel"
    assert r("auto", 16, 8) == "kernel"
    assert r("auto", 17, 8) == "xla"
    assert r("xla", 1, 8) == "xla"
    monkeypatch.setenv("JAXINFER_DECODE_MERGE", "xla")
    assert r("auto", 1, 8) == "xla"
    assert r("kernel", 8, 8) == "kernel"  # explicit beats the env
    monkeypatch.setenv("JAXINFER_DECODE_MERGE", "atomic")
    with pytest.raises(ValueError, match="JAXINFER_DECODE_MERGE"):
        r("auto", 1, 8)
    monkeypatch.delenv("JAXINFER_DECODE_MERGE")
    for B, in_kernel in ((1, True), (8, True), (16, True), (24, False)):  # ctx 2048; B24: 1 split
        args = decode_avals(B, 128, jnp.bfloat16)
        text = lower_paged_kernel(paged_decode_attention, args, jnp.bfloat16, 0)
        assert text.count("xla.gpu.triton") == 1
        assert ("_kmerge" in text) == in_kernel


def test_split_count_two_programs_an_sm():
    """choose_num_splits (8 KV heads, 256 blocks): two waves' worth of programs at B = 1,
    at most two programs an SM for 32-132 (batch, KV head) groups (floor(264 / groups):
    B = 4 / 6 / 8 measured best on the H200 in session 16, B = 16 in session 20), one split
    past a wave; the count never exceeds the blocks to split."""
    from pallas_kernels.paged_attention.decode_options import choose_num_splits

    got = [choose_num_splits(B, 8, 256) for B in (1, 2, 4, 6, 8, 12, 14, 15, 16, 64)]
    assert got == [33, 17, 8, 5, 4, 2, 2, 2, 2, 1]
    assert choose_num_splits(17, 8, 256) == 1  # 136 groups: past one wave
    assert choose_num_splits(4, 8, 3) == 3 and choose_num_splits(1, 8, 5) == 5
    assert choose_num_splits(8, 8, 256, target_programs=132) == 3  # explicit target: ceil


def test_split_grid_whole_steps_a_split():
    """split_grid (the decode kernels' launch, and the B1 probes'): each split takes whole
    steps, so the count can fall below the pick (B1 ctx4096: 33 wanted, 32 of 2 steps)."""
    from pallas_kernels.paged_attention.decode_options import split_grid

    assert split_grid(1, 8, 64, 4) == (16, 4)      # ctx1024, 64-token steps: one a split
    assert split_grid(1, 8, 128, 4) == (32, 4)     # ctx2048
    assert split_grid(1, 8, 256, 4) == (32, 8)     # ctx4096: two steps a split
    assert split_grid(8, 8, 256, 4) == (4, 64)     # B8: two programs an SM
    assert split_grid(1, 8, 256, 4, num_splits=64) == (64, 4)
    assert split_grid(1, 8, 10, 4, num_splits=64) == (3, 4)  # ragged table: 4 + 4 + 2 pages


def test_wave_num_splits_follows_flash_attention_rule():
    """wave_num_splits (FlashAttention's num_splits_heuristic) with 528 slots (4 programs an
    SM), 8 KV heads, 32 steps: the session-19/20 H200 winners -- B48 4 splits (2.9 waves, 1.45
    at 2), B32 2, B16 4, B64 / B128 one -- and the eligibility / 80 % rules."""
    from pallas_kernels.paged_attention import decode_options as do

    got = {B: do.wave_num_splits(8 * B, 32, 528) for B in (4, 16, 32, 48, 64, 128)}
    assert got == {4: 16, 16: 4, 32: 2, 48: 4, 64: 1, 128: 1}
    # 24 rows: 5 splits (960 programs, 1.82 waves: efficiency 0.91) -- the smallest within
    # 0.85 of the best (11 splits: exactly 4 waves); with keep 0.95 the first >= 0.95: 8
    assert do.wave_num_splits(192, 32, 528) == 5
    assert do.wave_num_splits(192, 32, 528, keep=0.95) == 8
    # never more splits than steps; only counts that change the steps a split count: B8 (64
    # groups) would fill 4 waves exactly at 33 splits, but of 64 steps 33 splits take 2 steps
    # each, as 32 do -- not eligible, so 8 (0.97) stays the best and 7 (0.85) is picked
    assert do.wave_num_splits(1, 3, 528) == 3
    assert do.wave_num_splits(64, 64, 528) == 7
    assert do.choose_num_splits(48, 8, 32, wave_slots=528) == 4
    assert do.choose_num_splits(48, 8, 32, target_programs=512, wave_slots=528) == 2
    assert do.split_grid(48, 8, 128, 4, wave_slots=528) == (4, 32)  # 8 steps of 4 pages


@pytest.mark.parametrize("B,maxp,kv,window,kw", [
    (1, 128, jnp.bfloat16, 0, {}),                         # B1 ctx2048: 32 splits
    (1, 2048, jnp.bfloat16, 0, {"num_splits": 64}),        # B1 ctx32k, 4 chunks in the merge
    (1, 256, F8, "traced", {}),                            # FP8 kq8 default, traced window
    (8, 64, jnp.bfloat16, 700, {"layout": "kq", "group_rows": 8}),
])
def test_lowers_for_cuda_as_one_launch(B, maxp, kv, window, kw):
    """Traces and lowers for an H200: one Triton call, the counters aliased to an output."""
    args = decode_avals(B, maxp, kv)
    text = lower_paged_kernel(paged_decode_attention, args, kv, window, merge="kernel", **kw)
    assert text.count("xla.gpu.triton") == 1
    assert "_kmerge" in text and "output_operand_aliases" in text


def test_bench_cpu_smoke(tmp_path, monkeypatch):
    """bench_paged_small_batch.py's CPU mode (tiny heads, interpreter): the device check of
    both merges passes and every implementation is timed and recorded (also when the module
    was imported long before, as by test_b1_floor_probe.py: the deadline is the run's)."""
    import json

    from benchmarks.kernels import bench_paged_attention, bench_paged_small_batch
    calls_for = bench_paged_attention.calls_for
    bench_paged_small_batch.T0 = 0.0  # imported long ago: the deadline counts from main()
    monkeypatch.setattr(decode_merge, "MERGE_PRELOAD_CHUNKS", 2)  # restored after the --patch
    target = "pallas_kernels.paged_attention.decode_merge.MERGE_PRELOAD_CHUNKS"
    bench_paged_small_batch.main(["--cpu-smoke", "--tunes", "w2", "--patch", f"{target}=0",
                                  "--out", str(tmp_path)])
    assert bench_paged_attention.calls_for is calls_for  # the smoke's patch is undone
    recs = json.loads((tmp_path / "paged_small_batch.json").read_text())
    checks = [r for r in recs if "/check_rel_err/" in r["name"]]
    assert len(checks) == 3 and all(r["config"]["ok"] for r in checks), checks
    timed = {r["config"]["impl"] for r in recs if "/check_rel_err/" not in r["name"]}
    assert timed == {"stock", "xla", "kfresh", "kcarry S2", "tune w2"}, timed
    assert all(r["config"]["patches"] == {target: 0} for r in recs)
    assert decode_merge.MERGE_PRELOAD_CHUNKS == 0
    tuned = [r for r in recs if r["config"].get("impl") == "tune w2"]
    assert tuned[0]["config"]["tune"] == str({"num_warps": 2}), tuned
    assert all(r["config"]["chain_rel_err_vs_xla"] == 0.0 for r in recs
               if r["config"].get("impl", "").startswith("k")), recs


def test_bench_tunes_parse_launch_options_and_reject_unknown_keys():
    """--tunes of bench_paged_small_batch.py: each token names num_warps / num_stages /
    block_tokens / unroll / num_splits / wave_slots values; a token it cannot read is an
    error, not a silently default run."""
    from benchmarks.kernels.bench_paged_small_batch import parse_tunes
    assert parse_tunes("w2,w8s3,bt32") == [
        ("w2", {"num_warps": 2}), ("w8s3", {"num_warps": 8, "num_stages": 3}),
        ("bt32", {"block_tokens": 32})]
    assert parse_tunes("u1,sp64u2") == [("u1", {"unroll": 1}),
                                        ("sp64u2", {"num_splits": 64, "unroll": 2})]
    assert parse_tunes("ws264,w4ws1056") == [
        ("ws264", {"wave_slots": 264}), ("w4ws1056", {"num_warps": 4, "wave_slots": 1056})]
    assert parse_tunes("") == []
    for bad in ("x3", "w", "w2q", "bt-1"):
        with pytest.raises(ValueError, match="--tunes"):
            parse_tunes(bad)


def test_bench_points_split_bf16_and_fp8():
    """--points / --checks of bench_paged_small_batch.py: bf16 'BxC' and FP8 'fp8:BxC'."""
    from benchmarks.kernels.bench_paged_small_batch import split_points
    assert split_points("1x1024,fp8:8x2048,32x2048,fp8:4x512") == (
        [(1, 1024), (32, 2048)], [(8, 2048), (4, 512)])
    assert split_points("") == ([], [])


def test_bench_patch_sets_constants_and_names_bad_specs(monkeypatch):
    """benchmarks.common.apply_patches (--patch of bench_paged_small_batch.py and
    gpu_decode.py): sets a module constant to a Python literal; a spec it cannot apply stops
    the run with a message naming it, rather than timing the unpatched code."""
    from benchmarks.common import apply_patches

    monkeypatch.setattr(decode_merge, "MERGE_CHUNK_ELEMS", decode_merge.MERGE_CHUNK_ELEMS)
    target = "pallas_kernels.paged_attention.decode_merge.MERGE_CHUNK_ELEMS"
    assert apply_patches([f"{target}=4096"], "bench") == {target: 4096}
    assert decode_merge.MERGE_CHUNK_ELEMS == 4096
    for bad in (target, f"{target}=four", "no_such_module.X=1",
                "pallas_kernels.paged_attention.decode_merge.NO_SUCH=1"):
        with pytest.raises(SystemExit, match="bench: --patch"):
            apply_patches([bad], "bench")


@pytest.mark.parametrize("heads", ["32/7/128", "32/8", "a/b/c"])
def test_bench_heads_option_rejects_what_it_cannot_use(heads, capsys):
    """--heads of bench_paged_small_batch.py (the timed points' Hq/Hkv/D): a value that is
    not three integers with Hq a multiple of Hkv stops the run with a usage error."""
    from benchmarks.kernels import bench_paged_small_batch
    with pytest.raises(SystemExit) as e:
        bench_paged_small_batch.main(["--heads", heads, "--no-checks", "--points", "1x256"])
    assert e.value.code == 2
    assert "--heads" in capsys.readouterr().err
    from benchmarks.kernels.bench_paged_attention import parse_heads
    assert parse_heads("16/8/256") == {"Hq": 16, "Hkv": 8, "D": 256}
    with pytest.raises(ValueError, match=f"heads '{heads}'"):
        parse_heads(heads)
