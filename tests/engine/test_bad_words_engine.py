"""``bad_words`` through the engine: greedy tokens equal a numpy reference of vLLM v1's
``apply_bad_words`` over ``prompt_logits`` (one-token words always banned, longer ones when
the outputs so far end with their prefix, prompt tokens not counted) in the one-step, async
and multi-step engines, beside a request without bad words; slots reused without them; the
last-output rows reloaded after preemption. The tiny model has no tokenizer: the words'
token sequences are given through ``jaxinfer.request_checks.encode_bad_words`` (its encoding is
tests/core/test_bad_words.py's)."""

from __future__ import annotations

import numpy as np
import pytest

from jaxinfer.engine import RequestError
from jaxinfer.llm import LLM
from jaxinfer.sampling_bad_words import MAX_BAD_WORD_TOKENS
from jaxinfer.sampling_params import SamplingParams
from tests.conftest import tiny_loaded

ENGINE = dict(max_model_len=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=32,
              max_prefill_seqs=4, decode_buckets=(1, 2, 4))
PROMPTS = [[5, 17, 33, 8, 61], [70, 2, 2, 45], [12, 90, 31, 7, 7, 7, 40], [9, 9, 3, 81]]


def _banned(seqs: list[list[int]], out: list[int]) -> list[int]:
    """vLLM v1 ``apply_bad_words``: the last token of each sequence whose prefix ends the
    outputs (a sequence longer than the outputs + 1 cannot match)."""
    return sorted({w[-1] for w in seqs if len(w) <= len(out) + 1
                   and (len(w) == 1 or out[len(out) - len(w) + 1:] == w[:-1])})


def _reference(engine, prompt: list[int], seqs: list[list[int]], n: int):
    """Greedy tokens with the bans; and the steps where a multi-token sequence fired."""
    out: list[int] = []
    fired = []
    for i in range(n):
        x = engine.prompt_logits(prompt + out)[-1].astype(np.float64)
        ban = _banned(seqs, out)
        if int(np.argmax(x)) in ban and any(len(w) > 1 and w[-1] == int(np.argmax(x))
                                            for w in seqs):
            fired.append(i)
        x[ban] = -np.inf
        out.append(int(np.argmax(x)))
    return out, fired


def _late_word(out: list[int], lo: int) -> list[int]:
    """The shortest run of 2-16 tokens of ``out`` that first ends at a step >= ``lo`` (the
    latest such step): a bad word that fires there, not before."""
    for t in range(len(out) - 1, lo - 1, -1):
        for n in range(2, MAX_BAD_WORD_TOKENS + 1):
            w = out[t - n + 1:t + 1]
            if all(out[i - n + 1:i + 1] != w for i in range(n - 1, t)):
                return w
    raise AssertionError(f"no run of {out} first ends at a step >= {lo}")


def _words(monkeypatch, table: dict[str, list[list[int]]]) -> None:
    """The engine encodes word ``k`` of a request as ``table[k]``."""
    def encode(tokenizer, words, vocab_size):
        return [s for w in words for s in table[w]]

    monkeypatch.setattr("jaxinfer.request_checks.encode_bad_words", encode)


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("engine_kw", [dict(async_scheduling=False), dict(),
                                       dict(num_scheduler_steps=4)],
                         ids=["sync", "async", "multi-step"])
def test_bad_words_ban_greedy_tokens_as_vllm(monkeypatch, engine_kw):
    loaded = tiny_loaded("llama")
    ref = LLM(loaded, **ENGINE).engine
    llm = LLM(loaded, **{**ENGINE, **engine_kw})
    free = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompt, other = PROMPTS[0], PROMPTS[2]
    plain, plain_other = _tokens(llm.generate([prompt, other], free))
    assert plain == _reference(ref, prompt, [], 12)[0]
    # One token always banned; a pair whose prefix is the first output; a pair whose
    # prefix is only the prompt's last token (never matches: prompt tokens do not count).
    seqs = [[plain[2]], [plain[0], plain[1]], [prompt[-1], plain[0]]]
    first, _ = _reference(ref, prompt, seqs, 12)
    # A three-token sequence from that trajectory: it fires at step 6.
    seqs.append(first[4:7])
    want, fired = _reference(ref, prompt, seqs, 12)
    assert want[0] == plain[0] and want[1] != plain[1] and plain[2] not in want
    assert 6 in fired and want[:6] == first[:6] and want[6] != first[6]
    _words(monkeypatch, {"a": seqs[:2], "b": seqs[2:]})
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, bad_words=["a", "b"])
    assert _tokens(llm.generate([prompt, other], [sp, free])) == [want, plain_other]
    assert _tokens(llm.generate([prompt], free)) == [plain]  # slots reused: no stale bans
    two = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, n=2,
                                                ignore_eos=True, bad_words=["a", "b"]))[0]
    assert [s.token_ids for s in two.outputs] == [want, want]  # forked samples: own tables
    # max_tokens=None through add_request: the engine fills in the room on the request's
    # checked copy, which keeps its encoded bad words
    engine = llm.engine
    rid = engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=None,
                                                    ignore_eos=True, bad_words=["a", "b"]))
    done = {}
    while engine.has_unfinished_requests():
        done |= {o.request_id: o for o in engine.step() if o.finished}
    got = done[rid].outputs[0].token_ids
    assert len(got) == ENGINE["max_model_len"] - len(prompt) and got[:12] == want
    assert not llm.engine.has_unfinished_requests()


def test_bad_words_survive_preemption(monkeypatch):
    """Four requests with bad words in too few pages: preempted ones are re-prefilled and
    their tables reloaded with the outputs they have, so a multi-token word still matches
    across the preemption; every output equals its reference."""
    loaded = tiny_loaded("llama")
    ref = LLM(loaded, **ENGINE).engine
    n = 20
    table, wants, params = {}, [], []
    for j, prompt in enumerate(PROMPTS):
        plain, _ = _reference(ref, prompt, [], n)
        seqs = [[plain[1 + j]]]
        first, _ = _reference(ref, prompt, seqs, n)
        seqs.append(_late_word(first, 12))
        table[f"w{j}"] = seqs
        want, fired = _reference(ref, prompt, seqs, n)
        assert want != plain and max(fired, default=0) >= 12, (j, fired)
        wants.append(want)
        params.append(SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True,
                                     bad_words=[f"w{j}"]))
    _words(monkeypatch, table)
    for kw in (dict(async_scheduling=False), dict(), dict(num_scheduler_steps=4)):
        llm = LLM(loaded, **ENGINE, **kw, num_kv_pages=17)
        preempted = []
        schedule = llm.engine.scheduler.schedule

        def spy(schedule=schedule, preempted=preempted):
            out = schedule()
            preempted.extend(out.preempted)
            return out

        llm.engine.scheduler.schedule = spy
        assert _tokens(llm.generate(PROMPTS, params)) == wants, kw
        assert preempted, kw


def test_bad_words_covering_the_allowed_tokens_are_refused(monkeypatch):
    """One-token bad words that ban every allowed token (alone, or with the stop tokens
    masked before min_tokens) leave nothing to sample: refused at admission, by name."""
    llm = LLM(tiny_loaded("llama"), **ENGINE)
    _words(monkeypatch, {"a": [[7], [9]], "b": [[7, 9]]})
    with pytest.raises(RequestError, match=r"^prompt 0 of the batch: bad_words ban "
                                           r"allowed_token_ids, so no token "
                                           r"could be sampled$"):
        llm.generate([PROMPTS[0]], SamplingParams(bad_words=["a"], allowed_token_ids=[9, 7]))
    with pytest.raises(RequestError, match=r"^prompt 0 of the batch: min_tokens 2: EOS and "
                                           r"stop_token_ids and "
                                           r"bad_words cover allowed_token_ids, so no token "
                                           r"could be sampled before then$"):
        llm.generate([PROMPTS[0]], SamplingParams(bad_words=["a"], allowed_token_ids=[7, 11],
                                                  stop_token_ids=[11], min_tokens=2))
    # A two-token word bans its last token only after its first: 9 stays possible.
    out = llm.generate([PROMPTS[0]], SamplingParams(bad_words=["b"], allowed_token_ids=[7, 9],
                                                    temperature=0.0, max_tokens=6))[0]
    ids = out.outputs[0].token_ids
    assert set(ids) <= {7, 9} and all(ids[i:i + 2] != [7, 9] for i in range(len(ids)))
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("engine_kw", [dict(async_scheduling=False), dict(),
                                       dict(num_scheduler_steps=4)],
                         ids=["sync", "async", "multi-step"])
def test_bans_that_leave_no_allowed_token_yield(monkeypatch, engine_kw):
    """After f (greedy's first pick among the allowed 7 and 9), the words (f, 7) and (f, 9)
    ban both allowed tokens: that step takes the allowed token with the larger logit (the
    bad words yield to allowed_token_ids), never a token outside them (argmax of an all
    -inf row was token 0; break-test report 66); greedy and seeded sampling."""
    loaded = tiny_loaded("llama")
    ref = LLM(loaded, **ENGINE).engine
    llm = LLM(loaded, **{**ENGINE, **engine_kw})
    prompt, allowed = PROMPTS[1], [7, 9]
    x = ref.prompt_logits(prompt)[-1]
    f = max(allowed, key=lambda t: x[t])
    seqs = [[f, 7], [f, 9]]
    _words(monkeypatch, {"w": seqs})
    want: list[int] = []
    stuck = 0
    for _ in range(10):
        x = ref.prompt_logits(prompt + want)[-1].astype(np.float64)
        left = [t for t in allowed if t not in _banned(seqs, want)]
        stuck += not left
        want.append(max(left or allowed, key=lambda t: x[t]))
    assert stuck > 0
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, bad_words=["w"],
                            allowed_token_ids=allowed)
    assert _tokens(llm.generate([prompt], greedy)) == [want]
    seeded = SamplingParams(temperature=1.0, seed=3, max_tokens=10, ignore_eos=True,
                            bad_words=["w"], allowed_token_ids=allowed)
    got = _tokens(llm.generate([prompt], seeded))[0]
    assert set(got) <= set(allowed), got


def test_bad_words_need_a_tokenizer_and_fitting_words():
    llm = LLM(tiny_loaded("llama"), **ENGINE)
    with pytest.raises(RequestError, match="bad_words need a tokenizer"):
        llm.generate([PROMPTS[0]], SamplingParams(bad_words=["x"]))
    assert not llm.engine.has_unfinished_requests()
