"""The compiled programs of a sample step (runner.py): the model program of every sample
bucket and every sampler variant contain no conditional, the reason the sampler runs as its
own program with static flags (on XLA:GPU a conditional blocks the host until the device
reaches it and splits command buffers)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

from jaxinfer.batch import SamplingArrays
from jaxinfer.compile import abstract_runner, enumerate_programs
from jaxinfer.config import EngineConfig
from jaxinfer.loading import DUMMY_CONFIGS
from jaxinfer.runner import COMPILER_OPTIONS, SAMPLE, SAMPLER
from jaxinfer.sampling import SAMPLER_VARIANTS, sample_rows

ENGINE = {"max_model_len": 64, "block_size": 16, "max_num_seqs": 2,
          "max_num_batched_tokens": 16, "max_prefill_seqs": 2}
CFG = DUMMY_CONFIGS["tiny-llama"]


def _conditionals(lowered: jax.stages.Lowered) -> int:
    """Conditionals in the lowered StableHLO and in the compiled (optimised) HLO."""
    text = lowered.as_text()
    hlo = lowered.compile(compiler_options=COMPILER_OPTIONS).as_text()
    return (len(re.findall(r"stablehlo\.(if|case)\b", text))
            + len(re.findall(r"\bconditional\(", hlo)))


@pytest.fixture(scope="module")
def runner():
    return abstract_runner(CFG, EngineConfig(**ENGINE))


def test_every_step_program_is_free_of_conditionals(runner):
    programs = [p for p in enumerate_programs(EngineConfig(**ENGINE), ["sample"])
                if p.mode in (SAMPLE, SAMPLER)]
    kinds = {p.bucket.kind for p in programs}
    assert {"prefill", "decode"} | set(SAMPLER_VARIANTS) <= kinds
    for p in programs:
        assert _conditionals(runner.lower(p.bucket, p.mode)) == 0, (p.mode, str(p.bucket))


def test_the_check_sees_the_device_decided_sampler():
    # needs=None, what the step compiled before the split: one lax.cond per part.
    S, sds = 2, jax.ShapeDtypeStruct
    sa = SamplingArrays(*(sds(a.shape, a.dtype) for a in SamplingArrays.neutral(S)))
    lowered = jax.jit(sample_rows).lower(sds((S, CFG.vocab_size), jnp.float32), sa,
                                         sds((3, CFG.vocab_size), jnp.int32))
    assert _conditionals(lowered) > 0
