"""benchmarks/multistep_decode.py on a tiny random model (CPU, float32): the program of n
decode steps under lax.fori_loop (token, positions, slot mapping and lengths advanced on the
device) gives the tokens of n single steps through the engine's programs, and writes the KV
cache the same way (a second run from the state the first left gives the same tokens)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.gpu_decode import make_engine
from benchmarks.multistep_decode import build_multistep, single_chain, step_inputs


@pytest.mark.parametrize("backend,b,ctx", [("reference", 2, 40), ("pallas", 3, 31)])
def test_multistep_program_equals_single_steps(backend, b, ctx):
    n = 6
    eng = make_engine("dummy:tiny-llama", backend, [b], ctx, 2 * n, dtype="float32")
    runner = eng.runner
    bucket, _, md, sa = step_inputs(eng, b, ctx, n)
    toks = jnp.arange(5, 5 + b, dtype=jnp.int32)  # rows start apart (their KV is all zeros)
    ref = single_chain(eng, bucket, toks, md, sa, n)
    assert ref.shape == (n, b) and len({tuple(r) for r in ref.T}) > 1  # rows differ
    prog = build_multistep(runner, n)
    for _ in range(2):
        got, runner.cache, runner.counts = prog(runner.weights, runner.cache, runner.counts,
                                                toks, md, sa)
        np.testing.assert_array_equal(np.asarray(got), ref)


def test_step_inputs_refuses_pages_beyond_the_bucket():
    eng = make_engine("dummy:tiny-llama", "reference", [1], 40, 8, dtype="float32")
    with pytest.raises(SystemExit, match="do not fit"):
        step_inputs(eng, 1, 40, 10_000)


def test_make_engine_backend_fields():
    """gpu_decode's backend string "attention[:quantization[:kv_cache_dtype]]"."""
    eng = make_engine("dummy:tiny-llama", "reference::fp8", [1], 40, 8, dtype="float32")
    assert eng.config.kv_cache_dtype == "fp8" and eng.config.quantization is None
    assert make_engine("dummy:tiny-llama", "reference", [1], 40, 8,
                       dtype="float32").config.kv_cache_dtype == "auto"
