"""SamplingParams.output_kind (vLLM's RequestOutputKind) through the engine on a tiny random
model: "delta" outputs concatenate to the "cumulative" ones (token ids, text with a held-back
stop string, logprobs), "final_only" gives one output at the end equal to the cumulative
final one, LLM.generate and the bench driver ask for the cheap kinds."""

from __future__ import annotations

import pytest

from jaxinfer.bench.driver import run_requests
from jaxinfer.sampling_params import ParameterError, SamplingParams
from tests.engine.test_sampling_engine import _llm, _with

PROMPTS = [[40, 50, 60, 70, 80], [22, 33, 44]]


def _steps(eng, params):
    """{request id: [its outputs, step by step]} for PROMPTS under ``params``."""
    rids = [eng.add_request(p, sp) for p, sp in zip(PROMPTS, params)]
    seen = {r: [] for r in rids}
    while eng.has_unfinished_requests():
        for o in eng.step():
            seen[o.request_id].append(o)
    return [seen[r] for r in rids]


def test_delta_and_final_only_match_cumulative(smollm_tokenizer):
    base = SamplingParams(temperature=0.9, seed=11, max_tokens=20, ignore_eos=True, logprobs=2)
    cum = _steps(_llm(smollm_tokenizer).engine, [base, _with(base, seed=12)])
    final_text = cum[0][-1].outputs[0].text
    stop = final_text[6:9]  # a stop string: held-back text must not leak into a delta
    params = [_with(base, stop=[stop]), _with(base, seed=12)]
    cum = _steps(_llm(smollm_tokenizer).engine, params)
    delta = _steps(_llm(smollm_tokenizer).engine,
                   [_with(sp, output_kind="delta") for sp in params])
    final = _steps(_llm(smollm_tokenizer).engine,
                   [_with(sp, output_kind="final_only") for sp in params])
    for c, d, f in zip(cum, delta, final):
        last = c[-1].outputs[0]
        assert len(d) == len(c) > 1 and len(f) == 1 and f[0].finished
        assert [o.finished for o in d] == [o.finished for o in c]
        assert sum((o.outputs[0].token_ids for o in d), []) == last.token_ids
        assert "".join(o.outputs[0].text for o in d) == last.text
        assert sum((o.outputs[0].logprobs for o in d), []) == last.logprobs
        for i, o in enumerate(d):  # each delta is what the cumulative output added
            prev = c[i - 1].outputs[0].token_ids if i else []
            assert prev + o.outputs[0].token_ids == c[i].outputs[0].token_ids
            assert o.outputs[0].cumulative_logprob == c[i].outputs[0].cumulative_logprob
        fo = f[0].outputs[0]
        assert (fo.token_ids, fo.text, fo.logprobs, fo.finish_reason, fo.stop_reason) == (
            last.token_ids, last.text, last.logprobs, last.finish_reason, last.stop_reason)
        assert f[0].prompt_token_ids == c[-1].prompt_token_ids
    assert cum[0][-1].outputs[0].stop_reason == stop  # the stop string did end request 0


def test_generate_and_bench_driver_use_the_cheap_kinds(monkeypatch):
    llm = _llm()
    kinds = []
    add = llm.engine.add_request
    monkeypatch.setattr(llm.engine, "add_request",
                        lambda p, sp, **kw: kinds.append(sp.output_kind) or add(p, sp, **kw))
    sp = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    out = llm.generate(PROMPTS, sp)
    assert kinds == ["final_only"] * 2 and sp.output_kind == "cumulative"  # not mutated
    assert [len(o.outputs[0].token_ids) for o in out] == [5, 5]
    kinds.clear()
    timelines, _ = run_requests(llm.engine, PROMPTS, [sp, sp])
    assert kinds == ["delta"] * 2
    assert [t.output_len for t in timelines] == [5, 5]  # every new token counted once


def test_bad_output_kind():
    with pytest.raises(ParameterError, match="output_kind must be one of cumulative, delta"):
        SamplingParams(output_kind="streaming")


def test_get_tokenizer_is_the_transformers_tokenizer(smollm_tokenizer):
    """vLLM's ``LLM.get_tokenizer()``: the transformers tokenizer (None without one)."""
    from jaxinfer import LLM
    from tests.conftest import tiny_loaded

    llm = _llm(smollm_tokenizer)
    hf = llm.get_tokenizer()
    assert hf is smollm_tokenizer.hf and hf.decode(hf.encode("hello world")) == "hello world"
    assert LLM(tiny_loaded("llama")).get_tokenizer() is None
