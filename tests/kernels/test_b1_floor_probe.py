"""benchmarks/kernels/b1_floor_probe.py in interpret mode: each probe reads exactly the K / V
elements it claims (per-program sums against numpy, ragged last page included), copies q,
and the run records every probe beside ours."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np

from benchmarks.kernels import b1_floor_probe as fp
from benchmarks.kernels import bench_paged_attention as bpa


def test_probe_sums_are_the_pages_they_read():
    c = bpa.make_case(1, 208, Hq=8, Hkv=2, D=64, L=2)
    c["lens"] = jnp.full((1,), 200, jnp.int32)
    errs = fp.check(c, interpret=True)  # raises past a probe's tolerance
    assert set(errs) == set(fp.MODES)
    assert all(e < fp.TOLERANCE.get(m, 1e-3) for m, e in errs.items()), errs
    direct, table = fp.expected_sums(c, "direct", 1), fp.expected_sums(c, "bt", 1)
    assert not np.allclose(direct, table)  # the block table is a permutation: a probe
    assert np.all(fp.expected_sums(c, "none", 1) == 0)  # reading the wrong pages fails


def test_cpu_smoke_records_every_probe(tmp_path):
    fp.main(["--cpu-smoke", "--sweep-splits", "2", "--sweep-block-tokens", "32",
             "--out", str(tmp_path)])
    recs = json.loads((tmp_path / "b1_floor_probe.json").read_text())
    impls = {r["config"]["impl"] for r in recs}
    assert impls == {*fp.MODES, "ours", "ours u0", "ours pre0", "bt S2w4b32",
                     "ours S2w4b32"}, impls
    swept = [r for r in recs if r["config"]["impl"] == "bt S2w4b32"]
    assert {r["config"]["splits"] for r in swept} == {2}, swept  # ctx 200: 2 splits
    assert {r["config"]["ctx"] for r in recs} == {200}
    assert all(r["value"] > 0 and r["unit"] == "us" for r in recs)


def test_probes_lower_for_cuda():
    """Each probe lowers for an H200 at the 8B heads (one Triton call), so the device call
    does not find a lowering error."""
    import functools

    from tests.kernels.cuda_lowering import decode_avals, lower_for_cuda

    avals = decode_avals(1, 128, jnp.bfloat16)
    for mode in fp.MODES:
        text = lower_for_cuda(functools.partial(fp.probe, mode=mode), *avals)
        assert text.count("xla.gpu.triton") == 1 and f"b1_probe_{mode}" in text, mode
