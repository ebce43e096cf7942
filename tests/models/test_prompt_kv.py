"""``LLMEngine.prompt_kv``: a prompt's KV cache read back from the engine's pages, against HF
transformers' ``past_key_values`` for the same checkpoint and ids (float32; fixtures
``tests/fixtures/tiny/<family>/kv_reference.npz`` from ``scripts/make_reference_fixtures.py
--only tiny-kv``)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import LLM
from jaxinfer.prompts import PromptTooLongError, RequestError

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "tiny"
TINY = ["llama", "mistral", "qwen2", "qwen3", "gemma3"]
# 24-token prompts in 4-token pages, prefilled in chunks of 16: a chunk boundary mid-prompt.
KW = dict(max_model_len=64, block_size=4, max_num_seqs=2, max_num_batched_tokens=16,
          prefill_buckets=(16,), dtype="float32")


def _check_against_hf(engine, ref, atol: float) -> None:
    cfg = engine.model_config
    free = engine.scheduler.block_manager.num_free_pages
    for row, ids in enumerate(ref["input_ids"]):
        k, v = engine.prompt_kv(ids.tolist())
        shape = (cfg.num_layers, len(ids), cfg.num_kv_heads, cfg.head_dim)
        assert k.shape == v.shape == shape and k.dtype == v.dtype == np.float32
        for layer in range(cfg.num_layers):
            for name, ours in (("k", k), ("v", v)):
                hf = ref[f"{name}{layer}"][row].transpose(1, 0, 2)  # [T_kept, Hkv, D]
                n = hf.shape[0]  # a sliding layer's HF cache keeps its window's last tokens
                assert n == len(ids) or cfg.layer_types[layer] == "sliding_attention"
                np.testing.assert_allclose(ours[layer, -n:], hf, atol=atol, rtol=0,
                                           err_msg=f"{name} layer {layer} row {row}")
    assert engine.scheduler.block_manager.num_free_pages == free  # the pages came back


@pytest.mark.parametrize("family", TINY)
def test_prompt_kv_equals_transformers_past_key_values(family):
    ref = np.load(FIXTURES / family / "kv_reference.npz")
    _check_against_hf(LLM(str(FIXTURES / family), **KW).engine, ref, atol=1e-4)


def test_prompt_kv_of_a_scanned_model_reads_the_stacked_pool():
    ref = np.load(FIXTURES / "gemma3" / "kv_reference.npz")
    engine = LLM(str(FIXTURES / "gemma3"), scan_layers=True, **KW).engine
    assert not engine.runner.cache.per_layer
    _check_against_hf(engine, ref, atol=1e-4)


def test_prompt_kv_of_an_fp8_pool_is_dequantized_with_its_scales():
    """Scales of 0.5 / 0.25: the pages hold value / scale, read back times the scale. Left
    out, the values would come back 2-4x too large; the rest is e4m3 rounding (3 mantissa
    bits: at most 1/16 relative, against each layer's largest value)."""
    ref = np.load(FIXTURES / "llama" / "kv_reference.npz")
    engine = LLM(str(FIXTURES / "llama"), kv_cache_dtype="fp8", **KW).engine
    cache = engine.runner.cache
    assert cache.per_layer and cache.k_scale is not None
    engine.runner.cache = dataclasses.replace(
        cache, k_scale=tuple(jnp.full_like(s, 0.5) for s in cache.k_scale),
        v_scale=tuple(jnp.full_like(s, 0.25) for s in cache.v_scale))
    k, v = engine.prompt_kv(ref["input_ids"][0].tolist())
    for layer in range(engine.model_config.num_layers):
        for name, ours in (("k", k), ("v", v)):
            hf = ref[f"{name}{layer}"][0].transpose(1, 0, 2)
            err = np.abs(ours[layer] - hf).max() / np.abs(hf).max()
            assert 0 < err <= 1 / 16, (name, layer, err)


def test_prompt_kv_refuses_what_prompt_logits_refuses():
    engine = LLM(str(FIXTURES / "llama"), **KW).engine
    with pytest.raises(PromptTooLongError, match="prompt has 65 tokens; max_model_len is 64"):
        engine.prompt_kv([5] * 65)
    with pytest.raises(RequestError):
        engine.prompt_kv([])
