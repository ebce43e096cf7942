"""The jnp references ignore every KV slot they must not read, as the kernels do: with NaN
in those slots (the null page that padding rows write, a freed page's stale values, the
positions before a sliding window, the other layer) their outputs equal those with zeros
there, and are finite. Before, a masked slot weighed 0 but 0 * NaN is NaN, so a NaN that a
research hook put in a padding row reached later requests through the null page on the
CPU's reference attention."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_attention import (
    paged_decode_attention_ref,
    paged_prefill_attention_ref,
)
from tests.kernels import test_paged_attention as dec
from tests.kernels import test_paged_prefill as pre


def _same_and_finite(dirty, clean) -> None:
    dirty, clean = np.asarray(dirty, np.float32), np.asarray(clean, np.float32)
    assert np.isfinite(dirty).all() and np.isfinite(clean).all()
    np.testing.assert_array_equal(dirty, clean)


@pytest.mark.parametrize("window, kv_dtype", [(0, jnp.float32), (5, jnp.float32),
                                              (0, jnp.float8_e4m3fn)])
def test_decode_reference_reads_no_masked_slot(window, kv_dtype):
    q, kd, vd, kc, vc, bt, lens = dec.make_case(
        window + 11, B=4, G=4, Hkv=2, D=64, ps=16, maxp=4, lens=[1, 16, 37, 0],
        kv_dtype=kv_dtype, window=window)
    kw = {"scale": 0.3, "window": window}
    if kv_dtype == jnp.float8_e4m3fn:
        kw |= {"k_scale": 0.5, "v_scale": 2.0}
    args = (jnp.int32(dec.LAYER), bt, lens)
    _same_and_finite(paged_decode_attention_ref(q, kd, vd, *args, **kw),
                     paged_decode_attention_ref(q, kc, vc, *args, **kw))


@pytest.mark.parametrize("window", [0, 7])
def test_prefill_reference_reads_no_masked_slot(window):
    c = pre.make_case(window + 3, seqs=[(0, 1), (0, 20), (9, 14), (30, 18)], G=2, Hkv=2,
                      D=64, ps=16, maxp=4, window=window)
    args = (jnp.int32(pre.LAYER), c["bt"], c["lens"], c["pos"], c["sid"])
    _same_and_finite(
        paged_prefill_attention_ref(c["q"], c["kd"], c["vd"], *args, scale=0.3, window=window),
        paged_prefill_attention_ref(c["q"], c["kc"], c["vc"], *args, scale=0.3, window=window))
