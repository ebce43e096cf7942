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


def _dot_precisions(lowered: jax.stages.Lowered) -> tuple[int, set[str]]:
    """(number of dot_general ops, the set of their operand precisions) in StableHLO."""
    text = lowered.as_text()
    dots = re.findall(r"stablehlo\.dot_general[^\n]*", text)
    return len(dots), {m for d in dots for m in re.findall(r"precision = \[(\w+),", d)}


@pytest.mark.parametrize("dtype, expected", [("float32", {"HIGHEST"}),
                                             ("bfloat16", {"DEFAULT"})])
def test_float32_models_multiply_in_float32(dtype, expected):
    """A float32 engine's dots (projections, attention, LM head) run at precision HIGHEST,
    not XLA:GPU's TF32 default (transformer.matmul_precision); bf16 ones at the default."""
    r = abstract_runner(CFG, EngineConfig(dtype=dtype, **ENGINE))
    for p in enumerate_programs(EngineConfig(dtype=dtype, **ENGINE), ["sample"]):
        if p.mode == SAMPLE:
            n, precisions = _dot_precisions(r.lower(p.bucket, p.mode))
            assert n >= 4 * CFG.num_layers and precisions == expected, (str(p.bucket), n)


def test_an_explicit_matmul_precision_wins():
    r = abstract_runner(CFG, EngineConfig(dtype="float32", **ENGINE))
    bucket = next(p.bucket for p in enumerate_programs(EngineConfig(**ENGINE), ["sample"])
                  if p.mode == SAMPLE and p.bucket.kind == "decode")
    with jax.default_matmul_precision("tensorfloat32"):
        n, precisions = _dot_precisions(r.lower(bucket, SAMPLE))
    assert n > 0 and precisions == {"HIGH"}
