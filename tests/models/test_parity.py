"""Parity with HF transformers (float32): logits and greedy tokens.

References come from scripts/make_reference_fixtures.py (torch + transformers, run once and
committed under tests/fixtures/): tiny random HF checkpoints of every family, loaded here
through the real HF-directory loader, and the two real GGUF models loaded by name.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams
from jaxinfer.loading import load_model

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
TINY = ["llama", "mistral", "qwen2", "qwen3", "gemma3"]
ATOL = 1e-3  # max-abs logits difference allowed, float32 on both sides


@pytest.mark.parametrize("family", TINY)
def test_tiny_hf_checkpoint_logits_and_greedy(family):
    d = FIXTURES / "tiny" / family
    ref = np.load(d / "reference.npz")
    llm = LLM(str(d), max_model_len=64, block_size=4, max_num_seqs=2,
              max_num_batched_tokens=32, dtype="float32")
    assert llm.engine.model_config.family == ("gemma3" if family == "gemma3" else "llama")
    for row in range(ref["input_ids"].shape[0]):
        ids = ref["input_ids"][row].tolist()
        logits = llm.engine.prompt_logits(ids)
        np.testing.assert_allclose(logits, ref["logits"][row], atol=ATOL, rtol=0)
    params = SamplingParams(temperature=0.0, max_tokens=ref["greedy_ids"].shape[1],
                            ignore_eos=True)
    outs = llm.generate([r.tolist() for r in ref["input_ids"]], params)
    for row, out in enumerate(outs):
        assert out.outputs[0].token_ids == ref["greedy_ids"][row].tolist()


def _real(name: str):
    meta = json.loads((FIXTURES / "real" / f"{name}.json").read_text())
    return meta, np.load(FIXTURES / "real" / f"{name}.npz")


@pytest.fixture(scope="module")
def gemma3_loaded():
    """gemma3-270m's weights, read once for the module: the engines built on them copy them
    (CausalLM takes ``dict(params)``), so the two gemma3 tests below share one load."""
    return load_model("gemma3-270m", progress=False)


@pytest.fixture(scope="module", params=[("smollm2-135m", "smollm2-135m-instruct"),
                                        ("gemma3-270m", "gemma3-270m")])
def real_model(request):
    model, fixture = request.param
    if not (FIXTURES / "real" / f"{fixture}.npz").exists():
        pytest.fail(f"missing fixture {fixture}.npz: run scripts/make_reference_fixtures.py")
    loaded = (request.getfixturevalue("gemma3_loaded") if model == "gemma3-270m"
              else load_model(model, progress=False))
    llm = LLM(loaded, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=128,
              dtype="float32")
    return llm, *_real(fixture)


def test_real_model_greedy_tokens_equal_transformers(real_model):
    llm, meta, ref = real_model
    prompts = meta["prompts"]
    assert len(prompts) >= 3
    ids = [ref[f"p{p['index']}_prompt_ids"].tolist() for p in prompts]
    if llm.tokenizer is not None:  # our tokenizer gives the same prompt ids
        for p, want in zip(prompts, ids):
            if p["kind"] == "plain":
                assert llm.tokenizer.encode(p["text"]) == want
    outs = llm.generate(ids, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
    for p, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == ref[f"p{p['index']}_greedy_ids"].tolist(), p["text"]


def test_real_model_logits_match_transformers(real_model):
    llm, meta, ref = real_model
    subset = ref["vocab_subset"]
    worst = 0.0
    for p in meta["prompts"]:
        i = p["index"]
        prompt, greedy = ref[f"p{i}_prompt_ids"], ref[f"p{i}_greedy_ids"]
        seq = np.concatenate([prompt, greedy]).tolist()
        logits = llm.engine.prompt_logits(seq)
        # Full vocabulary at the last prompt position; a fixed column subset everywhere.
        last = logits[len(prompt) - 1]
        np.testing.assert_allclose(last, ref[f"p{i}_last_logits"], atol=ATOL, rtol=0)
        tf = ref[f"p{i}_tf_logits"]
        np.testing.assert_allclose(logits[:tf.shape[0], subset], tf, atol=ATOL, rtol=0)
        worst = max(worst, float(np.abs(logits[:tf.shape[0], subset] - tf).max()))
    print(f"{meta['model']}: worst max-abs logits difference {worst:.2e} (float32)")


def test_gemma3_long_prompt_past_the_sliding_window(gemma3_loaded):
    """552 prompt tokens > Gemma 3's 512-token window: local layers must mask by window.

    Greedy ids and the last prompt position's full logits meet the 1e-3 bound. Over all 552
    teacher-forced positions two rows (386, 403) reach 4.5e-3 (5.2e-3 with the XLA:CPU code
    of session 11's machine, for the older commits too): they are ill-conditioned in float32
    for both implementations — against a float64 run of our model (x64 mode), our float32 is
    off by 3.4e-3 there and transformers' float32 by 1.0-1.7e-3, up to 5.1e-3 together — so
    the all-positions check uses 6e-3 (a missed window or RoPE base moves logits by > 0.5).
    """
    meta, ref = _real("gemma3-270m")
    assert any(p["key"] == "long0" for p in meta["long_prompts"])
    llm = LLM(gemma3_loaded, max_model_len=640, max_num_seqs=1,
              max_num_batched_tokens=256, dtype="float32")
    prompt = ref["long0_prompt_ids"].tolist()
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=32,
                                                ignore_eos=True))[0]
    assert out.outputs[0].token_ids == ref["long0_greedy_ids"].tolist()
    logits = llm.engine.prompt_logits(prompt)  # three 256-token chunks
    np.testing.assert_allclose(logits[-1], ref["long0_last_logits"], atol=ATOL, rtol=0)
    tf = ref["long0_tf_logits"][: len(prompt)]
    np.testing.assert_allclose(logits[:, ref["vocab_subset"]], tf, atol=6e-3, rtol=0)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_scanned_layers_match_unrolled_and_transformers(family):
    """The lax.scan path (compile time independent of depth) gives the same logits."""
    d = FIXTURES / "tiny" / family
    ref = np.load(d / "reference.npz")
    ids = ref["input_ids"][0].tolist()
    llm = LLM(str(d), max_model_len=64, block_size=4, max_num_seqs=1,
              max_num_batched_tokens=32, dtype="float32", scan_layers=True)
    assert llm.engine.runner.graphdef is not None and "layers__wqkv" in llm.engine.runner.state
    np.testing.assert_allclose(llm.engine.prompt_logits(ids), ref["logits"][0], atol=ATOL,
                               rtol=0)


def test_llama_config_with_a_sliding_window_key_keeps_full_attention(tmp_path):
    """transformers' Llama ignores ``sliding_window`` (modeling_llama.py has no window): a
    Llama config carrying one still matches the reference logits over 24 tokens > window 6."""
    import shutil

    d = tmp_path / "llama"
    shutil.copytree(FIXTURES / "tiny" / "llama", d)
    raw = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**raw, "sliding_window": 6}))
    ref = np.load(d / "reference.npz")
    llm = LLM(str(d), max_model_len=64, block_size=4, max_num_seqs=1,
              max_num_batched_tokens=32, dtype="float32")
    assert set(llm.engine.model_config.layer_types) == {"full_attention"}
    ids = ref["input_ids"][0].tolist()
    assert len(ids) > 6
    np.testing.assert_allclose(llm.engine.prompt_logits(ids), ref["logits"][0], atol=ATOL,
                               rtol=0)
