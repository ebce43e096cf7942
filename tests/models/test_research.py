"""jaxinfer.research: a prompt's hidden states against HF transformers'
``output_hidden_states`` (fixtures ``tiny/<family>/kv_reference.npz``), and hooks that edit
the residual stream."""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import LLM
from jaxinfer.prompts import RequestError
from jaxinfer.research import prompt_hidden_states

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "tiny"
TINY = ["llama", "mistral", "qwen2", "qwen3", "gemma3"]
KW = dict(max_model_len=64, block_size=4, max_num_seqs=2, max_num_batched_tokens=16,
          prefill_buckets=(16,), dtype="float32")  # 24-token prompts: two chunks


@pytest.mark.parametrize("family", TINY)
def test_hidden_states_and_logits_equal_transformers(family):
    ref = np.load(FIXTURES / family / "kv_reference.npz")
    logits_ref = np.load(FIXTURES / family / "reference.npz")["logits"]
    engine = LLM(str(FIXTURES / family), **KW).engine
    L, H = engine.model_config.num_layers, engine.model_config.hidden_size
    free = engine.scheduler.block_manager.num_free_pages
    for row, ids in enumerate(ref["input_ids"]):
        t = prompt_hidden_states(engine, ids.tolist())
        assert t.hidden_states.shape == (L + 1, 24, H) and t.layer_outputs.shape == (L, 24, H)
        np.testing.assert_allclose(t.hidden_states, ref["hidden_states"][:, row], atol=1e-4,
                                   rtol=1e-4)
        np.testing.assert_allclose(t.logits, logits_ref[row], atol=1e-3, rtol=0)
        np.testing.assert_array_equal(t.layer_outputs[:-1], t.hidden_states[1:-1])
        np.testing.assert_allclose(t.logits, engine.prompt_logits(ids.tolist()), atol=1e-5)
    assert engine.scheduler.block_manager.num_free_pages == free


@pytest.mark.parametrize("scan_layers", [False, True])
def test_a_hook_edits_the_residual_stream_of_its_layer(scan_layers):
    """Steering: a vector added to layer 0's output shows up exactly there, changes every
    later layer and the logits; the identity hook changes nothing. With scanned layers the
    layer index is traced, so the same jnp.where hook serves both."""
    ref = np.load(FIXTURES / "llama" / "kv_reference.npz")
    engine = LLM(str(FIXTURES / "llama"), scan_layers=scan_layers, **KW).engine
    ids = ref["input_ids"][0].tolist()
    base = prompt_hidden_states(engine, ids)
    np.testing.assert_allclose(base.hidden_states, ref["hidden_states"][:, 0], atol=1e-4,
                               rtol=1e-4)
    delta = np.random.default_rng(0).normal(size=engine.model_config.hidden_size)

    def steer(layer, x):
        return jnp.where(layer == 0, x + delta.astype(np.float32), x)

    steered = prompt_hidden_states(engine, ids, hook=steer)
    np.testing.assert_allclose(steered.layer_outputs[0], base.layer_outputs[0] + delta,
                               atol=1e-5, rtol=1e-5)
    assert np.abs(steered.layer_outputs[1] - base.layer_outputs[1]).max() > 0.1
    assert np.abs(steered.logits - base.logits).max() > 0.1
    same = prompt_hidden_states(engine, ids, hook=lambda layer, x: x)
    np.testing.assert_allclose(same.hidden_states, base.hidden_states, atol=1e-6)
    # Unrolled layers call the hook once per layer with a Python int, in order.
    if not scan_layers:
        seen = []
        prompt_hidden_states(engine, ids, hook=lambda layer, x: seen.append(layer) or x)
        assert seen == [0, 1]  # traced once: both 16-token chunks share the bucket


def test_an_ablation_hook_reaches_the_final_norm():
    """Zeroing the last layer's output: the final norm of zeros is zeros, so the last
    hidden state and the logits are all zero."""
    engine = LLM(str(FIXTURES / "llama"), **KW).engine
    last = engine.model_config.num_layers - 1
    t = prompt_hidden_states(engine, [3, 4, 5],
                             hook=lambda layer, x: x * 0 if layer == last else x)
    assert not t.hidden_states[-1].any() and not t.layer_outputs[-1].any()
    assert not t.logits.any() and t.hidden_states[:-1].any()


def test_bad_hooks_and_prompts_are_clear_errors():
    engine = LLM(str(FIXTURES / "llama"), **KW).engine
    free = engine.scheduler.block_manager.num_free_pages
    with pytest.raises(ValueError, match=r"hook returned shape \(16, 2\) for layer output "
                                         r"shape \(16, 64\)"):
        prompt_hidden_states(engine, [3, 4, 5], hook=lambda layer, x: x[:, :2])
    with pytest.raises(RequestError):
        prompt_hidden_states(engine, [])
    assert engine.scheduler.block_manager.num_free_pages == free  # nothing kept
    np.testing.assert_allclose(prompt_hidden_states(engine, [3, 4, 5]).logits,
                               engine.prompt_logits([3, 4, 5]), atol=1e-5)
