"""Straight-line splits of the paged decode kernel (``unroll``, decode.py) in interpret mode.

A split of at most ``unroll`` steps walks its fixed page range without a loop, reading the
block table before the sequence length: steps outside the sequence (or before a sliding
window) run on masked loads and are discarded. Conventions of test_paged_attention.py:
fresh random inputs, NaN in every cache slot the kernel must not read, permuted pages,
ragged lengths (0 = padding row, 1, page boundaries, a full table).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_attention import paged_decode_attention
from tests.kernels.cuda_lowering import decode_avals, lower_paged_kernel, triton_ir
from tests.kernels.test_paged_attention import LAYER, assert_close, make_case, run_both
from tests.kernels.test_paged_decode_variants import assert_variant_close

F8 = jnp.float8_e4m3fn
SCALES = {"k_scale": jnp.float32(0.7), "v_scale": jnp.float32(1.9)}
LENS = [0, 1, 16, 33, 64, 97, 128]  # padding, 1, a page, past a page, ..., the 8-page table


def case(seed: int, kv, window: int = 0, G: int = 4, D: int = 64):
    return make_case(seed, B=len(LENS), G=G, Hkv=2, D=D, ps=16, maxp=8, lens=LENS,
                     kv_dtype=kv, window=window)


@pytest.mark.parametrize("kv,G,D,bt,splits,merge,extra", [
    (jnp.float32, 4, 64, 16, 4, "kernel", {}),     # 2 steps a split, merge in the kernel
    (jnp.float32, 1, 64, 32, 2, "xla", {}),        # MHA, 2 steps of 2 pages, XLA merge
    (jnp.bfloat16, 4, 128, 16, 8, "kernel", {}),   # one step a split: empty splits
    (jnp.bfloat16, 8, 64, 32, 1, "xla", {}),       # no split: 4 steps, out written directly
    (F8, 4, 64, 32, 2, "kernel", {}),              # FP8 default variant (layout kq)
    (F8, 4, 64, 16, 4, "kernel", {"layout": "qk", "group_rows": 16, "fp8_dots": "qk"}),
])
def test_straight_line_equals_the_loop(kv, G, D, bt, splits, merge, extra):
    """Without a window the steps are the loop's steps, so the output is the loop's bit for
    bit (and the reference's within the dtype's tolerance)."""
    c = case(100 + G + D + splits, kv, G=G, D=D)
    kw = dict(block_tokens=bt, num_splits=splits, merge=merge, **extra,
              **(SCALES if kv == F8 else {}))
    looped, ref = run_both(c, **kw)
    straight, _ = run_both(c, unroll=4, **kw)
    if kv == F8:  # q in e4m3 with fp8_dots: the variants' own bound
        assert_variant_close(straight, ref, extra)
    else:
        assert_close(straight, ref, tight=kv == jnp.float32)
    np.testing.assert_array_equal(np.asarray(straight, np.float32),
                                  np.asarray(looped, np.float32))
    assert np.all(np.asarray(straight)[0] == 0)  # the padding row


@pytest.mark.parametrize("window,traced", [(20, False), (40, True), (200, True)])
def test_window_starts_mid_split(window, traced):
    """A sliding window that starts inside a split's range: the straight-line steps begin at
    the split's first page, not the window's, so the steps before it are all masked and
    dropped; a traced window (the engine's scan over layers) gives the same output."""
    c = case(7 + window, jnp.bfloat16, window=window)
    q, kd, vd, *_ = c
    kw = dict(block_tokens=16, num_splits=2, merge="kernel", unroll=4)
    out, ref = run_both(c, window=window, **kw)
    assert_close(out, ref, tight=False)
    if traced:
        f = jax.jit(lambda w, *a: paged_decode_attention(*a, scale=0.3, window=w,
                                                         interpret=True, **kw))
        again = f(jnp.int32(window), q, kd, vd, jnp.int32(LAYER), c[5], c[6])
        np.testing.assert_array_equal(np.asarray(again, np.float32),
                                      np.asarray(out, np.float32))


def test_default_unrolls_two_steps_only():
    """The default (decode_options.DEFAULT_UNROLL = 2): B1 ctx 8192 (32 splits of 4 steps)
    keeps the loop, as measured faster on the H200."""
    with triton_ir() as irs:
        lower_paged_kernel(paged_decode_attention, decode_avals(1, 512, jnp.bfloat16),
                           jnp.bfloat16, 0, merge="kernel")
    assert "scf.for" in irs[0] or "scf.while" in irs[0]


def test_unroll_bound_and_errors():
    """unroll below a split's step count keeps the loop (the same output); a negative or
    non-integer unroll is an error."""
    c = case(3, jnp.float32)
    kw = dict(block_tokens=16, num_splits=2)  # 4 steps a split
    below, ref = run_both(c, unroll=3, **kw)
    assert_close(below, ref, tight=True)
    for bad in (-1, 1.5):
        with pytest.raises(ValueError, match="unroll"):
            run_both(c, unroll=bad, **kw)


@pytest.mark.parametrize("B,maxp,kv,window,splits", [
    (1, 64, jnp.bfloat16, 0, None),        # B1 ctx1024: 16 splits of one 64-token step
    (1, 256, jnp.bfloat16, 0, 32),         # B1 ctx4096: 32 splits of two steps
    (1, 128, F8, "traced", None),          # FP8 default variant, traced window
])
def test_lowers_for_cuda_without_a_loop(B, maxp, kv, window, splits):
    """For an H200: the straight-line kernel has no loop over steps (one launch, the merge
    in the kernel); unroll 0 keeps the loop; the default (2) takes these 1-2 step splits
    straight-line and keeps the loop for B1 ctx 8192's 4 steps."""
    args = decode_avals(B, maxp, kv)
    for unroll, loops in ((4, False), (0, True), (None, False)):
        with triton_ir() as irs:
            text = lower_paged_kernel(paged_decode_attention, args, kv, window,
                                      merge="kernel", num_splits=splits, unroll=unroll)
        assert text.count("xla.gpu.triton") == 1 and len(irs) == 1
        assert ("scf.for" in irs[0] or "scf.while" in irs[0]) == loops, unroll
        assert ("_u_kmerge" in text) != loops
