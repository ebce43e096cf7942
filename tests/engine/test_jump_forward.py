"""Jump-forward decoding of structured outputs (``EngineConfig.jump_forward``, CPU): a tiny
random Llama with SmolLM2's vocabulary and tokenizer. Every output token is either sampled —
the argmax of the logits its grammar allows, from the engine's ``prompt_logits`` and a fresh
llguidance matcher — or, right after a sampled token, one of the tokens that matcher says
the grammar forces there; a row spends one step per sampled token; stop rules cut a jump;
rows that need every token sampled do not jump; the other engines give the same tokens."""

from __future__ import annotations

import json

import llguidance
import llguidance.numpy as lnp
import numpy as np
import pytest

from jaxinfer.llm import LLM
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.structured_outputs import StructuredOutputsParams as SO
from jaxinfer.structured_outputs import unpack_bitmask
from tests.engine.test_structured_outputs_engine import V
from tests.engine.test_structured_outputs_engine import _llm as structured_llm

SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["name", "ok", "count"],
          "properties": {"name": {"type": "string", "maxLength": 6}, "ok": {"type": "boolean"},
                         "count": {"type": "integer", "minimum": 0, "maximum": 99}}}
JSON = SO(json=SCHEMA, disable_any_whitespace=True)


def _llm(tokenizer, **kw) -> LLM:
    """The structured-outputs tests' engine, with jumps, synchronous unless ``kw`` says."""
    return structured_llm(tokenizer, **{"jump_forward": True, "async_scheduling": False, **kw})


@pytest.fixture(scope="module")
def llm(smollm_tokenizer) -> LLM:
    return _llm(smollm_tokenizer)


def _counting_steps(llm: LLM) -> list[int]:
    """Wrap ``llm.engine.step`` to count its calls (in the returned one-item list)."""
    eng, calls = llm.engine, [0]
    step = eng.step

    def counted():
        calls[0] += 1
        return step()

    eng.step = counted
    return calls


def _valid(text: str) -> bool:
    obj = json.loads(text)
    return (set(obj) == {"name", "ok", "count"} and isinstance(obj["name"], str)
            and len(obj["name"]) <= 6 and isinstance(obj["ok"], bool)
            and isinstance(obj["count"], int) and 0 <= obj["count"] <= 99)


def _greedy(llm: LLM, prompt: list[int], **kw) -> object:
    sp = SamplingParams(**{"temperature": 0.0, "max_tokens": 40, "structured_outputs": JSON,
                           **kw})
    return llm.generate([prompt], sp)[0].outputs[0]


def test_tokens_are_the_allowed_argmax_or_what_the_grammar_forces(llm) -> None:
    eng = llm.engine
    prompt = eng.encode_prompt("Answer:")
    calls = _counting_steps(llm)
    before = eng.num_jump_forward_tokens
    try:
        out = _greedy(llm, prompt)
    finally:
        del eng.step
    assert out.finish_reason == "stop" and _valid(out.text), out
    ref = llguidance.LLMatcher(eng.structured.ll_tokenizer(), JSON.grammar_text(), log_level=0)
    mask = lnp.allocate_token_bitmask(1, V)
    toks, i, sampled = out.token_ids, 0, 0
    while i < len(toks):  # a sampled token, then the tokens the grammar forces after it
        logits = eng.prompt_logits(prompt + toks[:i])[-1]
        lnp.fill_next_token_bitmask(ref, mask, 0)
        allowed = unpack_bitmask(mask[0], V)
        assert toks[i] == int(np.argmax(np.where(allowed, logits, -np.inf))), (i, toks)
        assert ref.consume_token(toks[i])
        sampled, i = sampled + 1, i + 1
        forced = [] if ref.is_stopped() else ref.compute_ff_tokens()
        assert toks[i:i + len(forced)] == forced, (i, forced, toks)
        assert not forced or ref.consume_tokens(forced)
        i += len(forced)
    assert ref.is_stopped()
    jumped = eng.num_jump_forward_tokens - before
    assert jumped == len(toks) - sampled >= 4  # the keys '"ok":' and '"count":' at least
    assert calls[0] == sampled  # one step per sampled token (the prompt's samples the 1st)
    assert not eng.structured._matchers and not eng.structured._grammars


def test_the_same_text_without_jumps_takes_a_step_per_token(llm, smollm_tokenizer) -> None:
    plain = _llm(smollm_tokenizer, jump_forward=False)
    prompt = plain.engine.encode_prompt("Answer:")
    calls = _counting_steps(plain)
    ref = _greedy(plain, prompt)
    out = _greedy(llm, prompt)
    assert calls[0] == len(ref.token_ids) and plain.engine.num_jump_forward_tokens == 0
    assert out.text == ref.text and _valid(out.text)


def test_stop_rules_cut_a_jump(llm) -> None:
    eng = llm.engine
    prompt = eng.encode_prompt("Answer:")
    full = _greedy(llm, prompt)
    text = full.text
    # A stop string inside forced text ('"ok":' is a key: forced): the output ends before it.
    cut = _greedy(llm, prompt, stop=['"ok'])
    assert cut.finish_reason == "stop" and cut.text == text[:text.index('"ok')]
    # max_tokens reached inside a jump: "length", exactly max_tokens tokens, a prefix.
    n = len(full.token_ids) - 2
    short = _greedy(llm, prompt, max_tokens=n)
    assert short.finish_reason == "length" and short.token_ids == full.token_ids[:n]
    assert not eng.scheduler.has_unfinished and not eng.structured._matchers


def test_a_forced_stop_token_is_masked_before_min_tokens(llm, smollm_tokenizer) -> None:
    """A stop token the grammar forces, before ``min_tokens`` outputs: the sampler would mask
    it, so the jump ends before it and the row samples there, as without jumps (the same
    tokens and finish reason), never emitting it early."""
    eng = llm.engine
    prompt = eng.encode_prompt("Answer:")
    full = _greedy(llm, prompt).token_ids
    ref = llguidance.LLMatcher(eng.structured.ll_tokenizer(), JSON.grammar_text(), log_level=0)
    assert ref.consume_token(full[0])
    forced = ref.compute_ff_tokens()  # what the first jump appends
    assert forced and full[1:1 + len(forced)] == forced
    stop, at = forced[-1], len(forced)  # output index of the forced stop token
    plain = _llm(smollm_tokenizer, jump_forward=False)
    kw = {"stop_token_ids": [stop], "min_tokens": at + 2}
    want = _greedy(plain, prompt, **kw)
    got = _greedy(llm, prompt, **kw)
    assert (got.token_ids, got.finish_reason) == (want.token_ids, want.finish_reason)
    assert stop not in got.token_ids[:at + 2]


@pytest.mark.parametrize("kw", [{"logprobs": 2}, {"repetition_penalty": 1.2},
                                {"logit_bias": {7: 0.5}}],
                         ids=["logprobs", "penalty", "logit_bias"])
def test_rows_that_need_every_token_sampled_do_not_jump(llm, kw) -> None:
    eng = llm.engine
    prompt = eng.encode_prompt("Answer:")
    before = eng.num_jump_forward_tokens
    calls = _counting_steps(llm)
    try:
        out = _greedy(llm, prompt, **kw)
    finally:
        del eng.step
    assert eng.num_jump_forward_tokens == before and calls[0] == len(out.token_ids)
    assert out.finish_reason == "stop" and _valid(out.text)
    if "logprobs" in kw:
        assert len(out.logprobs) == len(out.token_ids)


def test_no_row_waits_for_a_jump(llm) -> None:
    """A decoding unconstrained row and nothing to admit: a jump would stall it for a
    prefill step, so the constrained row samples every token; two constrained rows in step
    (the same greedy request) jump together, one step per sampled token."""
    eng = llm.engine
    prompt = eng.encode_prompt("Answer:")
    ref = _greedy(llm, prompt)
    before = eng.num_jump_forward_tokens
    plain = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    outs = llm.generate([prompt, prompt], [SamplingParams(
        temperature=0.0, max_tokens=40, structured_outputs=JSON), plain])
    assert eng.num_jump_forward_tokens == before
    assert outs[0].outputs[0].text == ref.text and len(outs[1].outputs[0].token_ids) == 60
    calls = _counting_steps(llm)
    try:
        pair = llm.generate([prompt, prompt], SamplingParams(
            temperature=0.0, max_tokens=40, structured_outputs=JSON))
    finally:
        del eng.step
    jumped = eng.num_jump_forward_tokens - before
    assert [o.outputs[0].token_ids for o in pair] == [ref.token_ids] * 2
    assert jumped > 0 and calls[0] == len(ref.token_ids) - jumped // 2


def _batch() -> list[SamplingParams]:
    return [SamplingParams(temperature=1.0, seed=5, n=2, max_tokens=40, structured_outputs=JSON),
            SamplingParams(temperature=0.0, max_tokens=12),  # unconstrained
            SamplingParams(temperature=0.8, seed=9, max_tokens=40, structured_outputs=JSON,
                           stop=["count"])]


def test_a_mixed_batch_is_the_same_on_every_engine(llm, smollm_tokenizer) -> None:
    prompts = [llm.engine.encode_prompt(t) for t in ("Answer:", "Hello", "JSON please")]
    ref = llm.generate(prompts, _batch())
    texts = [[c.text for c in r.outputs] for r in ref]
    for c in ref[0].outputs:
        assert c.finish_reason == "stop" and _valid(c.text), c
    assert ref[2].outputs[0].finish_reason == "stop" and "count" not in texts[2][0]
    plain = _llm(smollm_tokenizer, jump_forward=False).generate(prompts, _batch())
    assert plain[1].outputs[0].token_ids == ref[1].outputs[0].token_ids  # untouched row
    for kw in ({"async_scheduling": True}, {"num_scheduler_steps": 4},
               {"num_scheduler_steps": 4, "async_scheduling": True}):
        other = _llm(smollm_tokenizer, **kw)
        got = other.generate(prompts, _batch())
        assert [[c.token_ids for c in r.outputs] for r in got] == \
            [[c.token_ids for c in r.outputs] for r in ref], kw
        assert other.engine.num_jump_forward_tokens > 0


def test_preempted_rows_keep_their_forced_tokens(llm, smollm_tokenizer) -> None:
    """A pool too small for all rows preempts some (recompute): the forced tokens they
    hold are recomputed with the rest, and the tokens equal the roomy engine's."""
    sps = [SamplingParams(temperature=1.0, seed=20 + i, max_tokens=40, structured_outputs=JSON)
           for i in range(6)]
    prompts = [f"row {i} says" for i in range(6)]
    want = [r.outputs[0].token_ids for r in llm.generate(prompts, sps)]
    small = _llm(smollm_tokenizer, num_kv_pages=16, enable_prefix_caching=False)
    got = small.generate(prompts, sps)
    assert small.engine.scheduler.num_preemptions_total > 0
    assert small.engine.num_jump_forward_tokens > 0
    assert [r.outputs[0].token_ids for r in got] == want
    for r in got:
        assert r.outputs[0].finish_reason == "stop" and _valid(r.outputs[0].text)


def test_the_cli_flag_turns_it_on() -> None:
    from jaxinfer import cli

    ns = cli.build_parser().parse_args(["generate", "--jump-forward", "hi"])
    assert cli._engine_args(ns)["jump_forward"] is True
    ns = cli.build_parser().parse_args(["generate", "hi"])
    assert "jump_forward" not in cli._engine_args(ns)
