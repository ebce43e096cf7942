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


def test_a_hook_that_writes_nan_leaves_later_calls_unchanged():
    """A NaN a hook puts in the padding rows stays out of the real rows, and neither that
    nor a hook that makes every row NaN changes later calls without a hook (the KV slots
    the padding and the NaN run wrote, the null page and borrowed pages, are masked out;
    break-test 67: 0 * NaN had reached them through the reference attention)."""
    from jaxinfer import SamplingParams

    llm = LLM(str(FIXTURES / "llama"), **{**KW, "num_kv_pages": 12})
    engine = llm.engine
    q = [7, 3, 9, 1, 4, 4, 8, 2, 6, 5, 3]
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    before = engine.prompt_logits(q)
    tokens = llm.generate([q], greedy)[0].outputs[0].token_ids
    base = prompt_hidden_states(engine, [3, 4, 5])
    padded = prompt_hidden_states(engine, [3, 4, 5],
                                  hook=lambda layer, x: x.at[3:].set(jnp.nan))  # 16 rows
    np.testing.assert_allclose(padded.logits, base.logits, atol=1e-6)
    poisoned = prompt_hidden_states(engine, list(range(1, 25)), hook=lambda layer, x: x * jnp.nan)
    assert np.isnan(poisoned.logits).all()
    for _ in range(3):  # the pages it borrowed are reused
        np.testing.assert_allclose(engine.prompt_logits(q), before, atol=1e-6)
        assert llm.generate([q], greedy)[0].outputs[0].token_ids == tokens


def test_a_hook_may_take_positions_and_args():
    """A three-argument hook gets each row's position in the prompt (-1 for padding), so it
    patches by position across chunks and can keep padding out; a four-argument one gets
    ``hook_args``, whose new values reuse the compiled program."""
    from jaxinfer.research import _PROGRAMS

    ref = np.load(FIXTURES / "llama" / "kv_reference.npz")
    engine = LLM(str(FIXTURES / "llama"), **KW).engine  # 24 tokens: chunks of 16 and 8 (+8)
    ids = ref["input_ids"][0].tolist()
    base = prompt_hidden_states(engine, ids)

    def patch(layer, x, positions):  # position 20 sits in the second chunk, row 4
        x = jnp.where((positions < 0)[:, None], jnp.nan, x)  # padding rows: never read
        return jnp.where((positions == 20)[:, None] & (layer == 0), 0.0, x)

    t = prompt_hidden_states(engine, ids, hook=patch)
    assert not t.layer_outputs[0, 20].any()
    np.testing.assert_array_equal(t.layer_outputs[0, :20], base.layer_outputs[0, :20])
    np.testing.assert_array_equal(t.layer_outputs[:, :20], base.layer_outputs[:, :20])
    assert np.abs(t.logits[20:] - base.logits[20:]).max() > 1e-3 and np.isfinite(t.logits).all()

    delta = np.random.default_rng(1).normal(size=engine.model_config.hidden_size)

    def steer(layer, x, positions, strength):
        return jnp.where(layer == 0, x + strength * delta.astype(np.float32), x)

    n = len(_PROGRAMS[engine.runner])
    zero = prompt_hidden_states(engine, ids, hook=steer, hook_args=jnp.float32(0.0))
    np.testing.assert_allclose(zero.logits, base.logits, atol=1e-6)
    for strength in (1.0, 2.0):
        s = prompt_hidden_states(engine, ids, hook=steer, hook_args=jnp.float32(strength))
        np.testing.assert_allclose(s.layer_outputs[0], base.layer_outputs[0] + strength * delta,
                                   atol=1e-5, rtol=1e-5)
    assert len(_PROGRAMS[engine.runner]) == n + 1  # one program for the three strengths


def test_research_inputs_are_checked_by_name():
    import dataclasses

    llm = LLM(str(FIXTURES / "llama"), **{**KW, "num_kv_pages": 8})
    engine = llm.engine
    want = engine.prompt_logits([3, 4, 5])
    with pytest.raises(TypeError, match="hook must be a function .* got int"):
        prompt_hidden_states(engine, [3, 4, 5], hook=5)
    with pytest.raises(TypeError, match="hook takes 1 arguments"):
        prompt_hidden_states(engine, [3, 4, 5], hook=lambda x: x)
    with pytest.raises(ValueError, match="hook returned NoneType, not an array"):
        prompt_hidden_states(engine, [3, 4, 5], hook=lambda layer, x: None)
    with pytest.raises(TypeError, match="hook_args are the hook's fourth argument"):
        prompt_hidden_states(engine, [3, 4, 5], hook=lambda layer, x: x, hook_args=1.0)
    with pytest.raises(TypeError, match="engine must be an LLMEngine .* got NoneType"):
        prompt_hidden_states(None, [3, 4, 5])
    with pytest.raises(RequestError, match=r"takes one prompt, not a list of prompts"):
        prompt_hidden_states(engine, [[3, 4], [5]])
    with pytest.raises(RequestError, match="needs 13 KV pages; the pool has 7 in all"):
        engine.prompt_logits(list(range(1, 50)))

    @dataclasses.dataclass
    class Scale:  # unhashable: its programs are kept by identity
        k: float

        def __call__(self, layer, x):
            return x * self.k

    np.testing.assert_allclose(prompt_hidden_states(engine, [3, 4, 5], hook=Scale(1.0)).logits,
                               want, atol=1e-5)
    from jaxinfer.research import _PROGRAMS

    scale = Scale(1.0)
    n = len(_PROGRAMS[engine.runner])
    for _ in range(2):  # a bound method of an unhashable object: one program, not one a call
        prompt_hidden_states(engine, [3, 4, 5], hook=scale.__call__)
    assert len(_PROGRAMS[engine.runner]) == n + 1
    t = prompt_hidden_states(llm, jnp.asarray([3, 4, 5]))  # an LLM, a jax array of ids
    np.testing.assert_allclose(t.logits, want, atol=1e-5)
