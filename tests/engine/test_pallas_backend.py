"""The engine with the Pallas attention backend (interpret mode on CPU) equals the reference."""

from __future__ import annotations

import jax.numpy as jnp

from jaxinfer import LLM, SamplingParams
from tests.conftest import tiny_loaded


def test_pallas_backend_greedy_equals_reference():
    prompts = [[5, 6, 7], [9] * 9, list(range(10, 27))]
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    kw = dict(max_model_len=64, block_size=16, max_num_seqs=4, max_num_batched_tokens=64,
              decode_buckets=(4,), prefill_buckets=(64,), page_buckets=(4,))
    ref = LLM(tiny_loaded("llama", head_dim=16), attention_backend="reference", **kw)
    pal = LLM(tiny_loaded("llama", head_dim=16), attention_backend="pallas", **kw)
    assert pal.engine.runner.attention.name == "pallas"
    want = [o.outputs[0].token_ids for o in ref.generate(prompts, sp)]
    got = [o.outputs[0].token_ids for o in pal.generate(prompts, sp)]
    assert got == want
    assert pal.engine.runner.cache.dtype == jnp.float32
