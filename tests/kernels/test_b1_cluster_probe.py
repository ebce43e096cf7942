"""benchmarks/kernels/b1_cluster_probe.py on the CPU: the read probe sums exactly the pages of
each split (Mosaic GPU interpreter, against numpy), the split grid, and both probes (the
cluster merge through ``cluster_ref``, which the interpreter lacks) lower for an H200."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.kernels import b1_cluster_probe as cp
from benchmarks.kernels import bench_paged_attention as bpa
from tests.kernels.cuda_lowering import decode_avals, lower_for_cuda


def test_read_probe_sums_the_pages_of_each_split():
    c = bpa.make_case(1, 256, Hq=8, Hkv=2, D=64, L=2)
    errs = cp.check(c, C=2, interpret=True)  # raises past 1e-3 or when q is not copied
    assert set(errs) == {"mg_read"} and errs["mg_read"] < 1e-3, errs
    per_split, per_cluster = cp.expected(c, "mg_read", 1, 2), cp.expected(c, "mg_cluster", 1, 2)
    assert per_split.shape == (1, 2, 2, 16, 64) and per_cluster.shape == (1, 2, 1, 16, 64)
    np.testing.assert_allclose(per_split.sum(axis=2, keepdims=True), per_cluster)
    other = bpa.make_case(1, 256, Hq=8, Hkv=2, D=64, L=2, seed=1)  # other pages, other sums
    assert not np.allclose(cp.expected(other, "mg_read", 1, 2), per_split)


def test_grid_of():
    assert cp.grid_of(64, 8) == (8, 8) and cp.grid_of(256, 8) == (16, 16)
    assert cp.grid_of(128, 16) == (16, 8) and cp.grid_of(16, 2) == (2, 8)
    with pytest.raises(ValueError, match="do not split"):
        cp.grid_of(24, 16)


@pytest.mark.parametrize("ctx,C", [(1024, 8), (4096, 8), (2048, 16)])
@pytest.mark.parametrize("mode", cp.MODES)
def test_probes_lower_for_cuda(ctx, C, mode):
    """One Mosaic GPU custom call each at the 8B heads, so the device call's compile is not
    the first look at the cluster code."""
    text = lower_for_cuda(
        lambda q, kc, vc, layer, bt, lens: cp.cluster_probe(q, kc, vc, layer, bt, mode=mode,
                                                            C=C),
        *decode_avals(1, ctx // 16, jnp.bfloat16))
    assert text.count("custom_call @mosaic_gpu") == 1


def test_cpu_smoke_records(tmp_path):
    cp.main(["--cpu-smoke", "--out", str(tmp_path)])
    recs = json.loads((tmp_path / "b1_cluster_probe.json").read_text())
    assert {r["config"]["impl"] for r in recs} == {"mg_read C2"}
    assert all(r["value"] > 0 and r["config"]["splits"] == 2 for r in recs)
