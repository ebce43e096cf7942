"""Structured outputs through the engine (CPU): a tiny random Llama with SmolLM2's vocabulary
and tokenizer. Greedy tokens are checked against a reference built from the engine's
``prompt_logits`` and a fresh llguidance matcher (each token is the argmax of the logits the
grammar allows); outputs parse; the async and multi-step engines give the sync engine's
tokens; bad grammars are refused without losing anything; matchers are freed."""

from __future__ import annotations

import json
import re

import llguidance
import llguidance.numpy as lnp
import numpy as np
import pytest

from jaxinfer.engine import RequestError
from jaxinfer.llm import LLM
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.structured_outputs import StructuredOutputsParams as SO
from jaxinfer.structured_outputs import unpack_bitmask
from tests.conftest import tiny_loaded

V = 49152  # SmolLM2's vocabulary
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "ok"],
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "ok": {"type": "boolean"}}}
REGEX = r"[0-9]{3}-[a-z]{2}"
CHOICES = ["yes", "no", "maybe so"]


def _llm(tokenizer, **kw) -> LLM:
    args = dict(max_model_len=96, block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    args.update(kw)
    loaded = tiny_loaded("llama", vocab_size=V)
    loaded.tokenizer = tokenizer
    return LLM(loaded, **args)


@pytest.fixture(scope="module")
def llm(smollm_tokenizer) -> LLM:
    return _llm(smollm_tokenizer)


def _valid(so: SO, text: str) -> bool:
    if so.choice is not None:
        return text in so.choice
    if so.regex is not None:
        return re.fullmatch(so.regex, text) is not None
    obj = json.loads(text)
    return (set(obj) == {"name", "ok"} and isinstance(obj["name"], str)
            and len(obj["name"]) <= 6 and isinstance(obj["ok"], bool))


@pytest.mark.parametrize("so", [SO(choice=CHOICES), SO(regex=REGEX),
                                SO(json=SCHEMA, disable_any_whitespace=True)],
                         ids=["choice", "regex", "json"])
def test_greedy_tokens_are_the_argmax_of_what_the_grammar_allows(llm, so) -> None:
    eng = llm.engine
    prompt = eng.encode_prompt("Answer:")
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=40,
                                                structured_outputs=so))[0].outputs[0]
    assert out.finish_reason == "stop" and _valid(so, out.text), out
    # Reference: a matcher of our own over llguidance's tokenizer, the logits of each
    # prefix from the logits program, argmax over the allowed tokens.
    ref = llguidance.LLMatcher(eng.structured.ll_tokenizer(), so.grammar_text(), log_level=0)
    mask = lnp.allocate_token_bitmask(1, V)
    for i, tok in enumerate(out.token_ids):
        logits = eng.prompt_logits(prompt + out.token_ids[:i])[-1]
        lnp.fill_next_token_bitmask(ref, mask, 0)
        allowed = unpack_bitmask(mask[0], V)
        assert allowed.sum() < V  # the grammar constrains every position here
        assert tok == int(np.argmax(np.where(allowed, logits, -np.inf))), (i, tok)
        assert ref.consume_token(tok)
    assert ref.is_stopped()  # the engine stopped where the grammar ends
    assert not eng.structured._matchers and not eng.structured._grammars


def _batch() -> list[SamplingParams]:
    return [SamplingParams(temperature=1.0, seed=11, n=2, max_tokens=40,
                           structured_outputs=SO(json=SCHEMA, disable_any_whitespace=True)),
            SamplingParams(temperature=0.9, seed=12, max_tokens=12),  # unconstrained
            SamplingParams(temperature=1.0, seed=13, max_tokens=12, structured_outputs=SO(
                regex=REGEX)),
            SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)]  # outlives them


def _tokens(outs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outs]


def test_async_and_multi_step_engines_give_the_sync_tokens(llm, smollm_tokenizer) -> None:
    prompts = ["a", "bb", "ccc", "dddd"]
    ref = llm.generate(prompts, _batch())
    for o, sp in zip(ref, _batch()):
        for c in o.outputs:
            if sp.structured_outputs is not None:
                assert c.finish_reason == "stop" and _valid(sp.structured_outputs, c.text), c
    assert len({c.text for c in ref[0].outputs}) == 2  # two samples, two outputs
    for kw in ({"async_scheduling": True}, {"num_scheduler_steps": 4},
               {"num_scheduler_steps": 4, "async_scheduling": True}):
        other = _llm(smollm_tokenizer, **kw)
        assert _tokens(other.generate(prompts, _batch())) == _tokens(ref), kw
        eng = other.engine
        assert not eng.structured._matchers and not eng.structured._grammars
        if kw.get("num_scheduler_steps"):  # windows resume once the constrained rows end
            assert eng.num_multi_steps > 0


def test_allowed_token_ids_narrow_the_grammar(llm, smollm_tokenizer) -> None:
    tok = smollm_tokenizer
    no = tok.encode("no", add_special_tokens=False)
    sp = SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=SO(choice=CHOICES),
                        allowed_token_ids=no + list(tok.eos_token_ids))
    out = llm.generate(["Answer:"], sp)[0].outputs[0]
    assert (out.text, out.finish_reason) == ("no", "stop")
    assert not llm.engine.structured._allowed  # its packed allowed ids freed with it


def test_bad_grammar_is_refused_and_nothing_is_lost(llm) -> None:
    eng = llm.engine
    with pytest.raises(RequestError, match=r"structured_outputs.regex is not a valid regex"):
        eng.add_request("x", SamplingParams(structured_outputs=SO(regex="(a")))
    with pytest.raises(RequestError, match=r"structured_outputs.json is not a valid json"):
        eng.add_request("x", SamplingParams(structured_outputs=SO(json={"type": "nope"})))
    assert not eng.has_unfinished_requests() and not eng.structured._grammars
    out = llm.generate(["x"], SamplingParams(temperature=0.0, max_tokens=8,
                                             structured_outputs=SO(choice=CHOICES)))
    assert out[0].outputs[0].text in CHOICES


def test_abort_frees_the_matchers(llm) -> None:
    eng = llm.engine
    rid = eng.add_request("x", SamplingParams(temperature=1.0, seed=1, max_tokens=40, n=2,
                                              structured_outputs=SO(json_object=True)))
    eng.step()
    eng.step()
    assert eng.structured.has(rid) and eng.structured._matchers
    assert eng.abort_request(rid)
    assert not eng.structured._matchers and not eng.structured._grammars


def test_a_model_without_a_tokenizer_refuses_them() -> None:
    llm = LLM(tiny_loaded("llama"), max_model_len=64, block_size=4, max_num_seqs=4,
              max_num_batched_tokens=32)
    with pytest.raises(RequestError, match="structured_outputs need a tokenizer; this model "
                                           "has none"):
        llm.engine.add_request([5, 6], SamplingParams(structured_outputs=SO(regex="a")))
    assert not llm.engine.has_unfinished_requests()


def test_warm_up_builds_the_grammar_tokenizer(smollm_tokenizer) -> None:
    from jaxinfer.warmup import warm_up

    eng = _llm(smollm_tokenizer, decode_buckets=(8,)).engine
    assert eng.structured._ll_tokenizer is None  # built on first use, or by the warm-up
    warm_up(eng, jobs=2)
    assert eng.structured._ll_tokenizer is not None
    assert eng.structured._ll_tokenizer.vocab_size == V


def test_preempted_rows_resume_their_grammar(llm, smollm_tokenizer) -> None:
    """A pool too small for all rows preempts some (recompute): their matchers keep their
    state, and the tokens equal the roomy engine's."""
    sps = [SamplingParams(temperature=1.0, seed=20 + i, max_tokens=40, structured_outputs=SO(
        json=SCHEMA, disable_any_whitespace=True)) for i in range(6)]
    prompts = [f"row {i} says" for i in range(6)]
    ref = llm.generate(prompts, sps)
    small = _llm(smollm_tokenizer, num_kv_pages=24, enable_prefix_caching=False)
    got = small.generate(prompts, sps)
    assert small.engine.scheduler.num_preemptions_total > 0
    assert _tokens(got) == _tokens(ref)
    for o in got:
        assert o.outputs[0].finish_reason == "stop" and _valid(sps[0].structured_outputs,
                                                                 o.outputs[0].text)


def test_a_grammar_left_no_token_aborts_the_row(llm, smollm_tokenizer) -> None:
    """allowed_token_ids that the grammar allows none of at the first token: refused when
    the request is added (nothing queued); at a later token: the sampler has no finite
    logit, the token it takes is refused by the grammar and the row finishes "abort"
    (logged)."""
    yes = smollm_tokenizer.encode("yes", add_special_tokens=False)
    no = smollm_tokenizer.encode("no", add_special_tokens=False)
    sp = SamplingParams(temperature=0.0, max_tokens=8, allowed_token_ids=no,
                        structured_outputs=SO(choice=["yes"]))
    with pytest.raises(RequestError, match="choice: none of allowed_token_ids may start"):
        llm.engine.add_request("Answer:", sp)
    assert not llm.engine.has_unfinished_requests()
    sp = SamplingParams(temperature=0.0, max_tokens=8, allowed_token_ids=yes + no,
                        structured_outputs=SO(choice=["yes sir"]))
    out = llm.generate(["Answer:"], sp)[0].outputs[0]
    assert out.finish_reason == "abort" and out.token_ids[:len(yes)] == yes
    assert len(out.token_ids) == len(yes) + 1
    assert not llm.engine.has_unfinished_requests()


def test_structured_active_only_while_such_a_request_lives(llm) -> None:
    """``GrammarMatchers.active`` (which lets a step skip looking for rows to mask) is false
    in every step of unconstrained requests, and true, with a mask loader, in a constrained
    one's first step."""
    from jaxinfer import engine_slots

    seen = []
    real = engine_slots.structured_masks

    def spy(engine, out):
        loader = real(engine, out)
        seen.append((engine.structured.active, loader is not None))
        return loader

    engine_slots.structured_masks = spy
    try:
        llm.generate(["x"], SamplingParams(temperature=0.0, max_tokens=3))
        plain = list(seen)
        seen.clear()
        llm.generate(["x"], SamplingParams(temperature=0.0, max_tokens=3,
                                           structured_outputs=SO(choice=CHOICES)))
    finally:
        engine_slots.structured_masks = real
    assert plain and all(s == (False, False) for s in plain)
    assert seen and seen[0] == (True, True)
