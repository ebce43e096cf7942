"""``min_tokens`` masks a request's stop tokens (EOS unless ``ignore_eos``, ``stop_token_ids``)
until it has that many outputs, as vLLM v1's ``MinTokensLogitsProcessor``: greedy outputs
against a numpy reference built from ``prompt_logits``, in the one-step, async and multi-step
engines; stale stop flags of a reused slot change nothing; more stop ids than one history
call flags."""

from __future__ import annotations

import numpy as np
import pytest

from jaxinfer.engine import RequestError
from jaxinfer.llm import LLM
from jaxinfer.sampling_params import SamplingParams
from tests.conftest import tiny_loaded

ENGINE = dict(max_model_len=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=32,
              max_prefill_seqs=4, decode_buckets=(1, 2, 4))
PROMPTS = [[5, 17, 33, 8, 61], [70, 2, 2, 45], [12, 90, 31, 7, 7, 7, 40]]


def _reference(engine, prompt, stops, min_tokens, max_tokens, penalty=1.0):
    """Greedy tokens and finish reason: stop tokens at -inf before ``min_tokens`` outputs
    (and a repetition penalty over prompt and outputs), stop after."""
    out: list[int] = []
    for i in range(max_tokens):
        x = engine.prompt_logits(prompt + out)[-1].astype(np.float64)
        seen = np.isin(np.arange(len(x)), prompt + out)
        x[seen] = np.where(x[seen] > 0, x[seen] / penalty, x[seen] * penalty)
        if i < min_tokens:
            x[sorted(stops)] = -np.inf
        out.append(int(np.argmax(x)))
        if i + 1 >= min_tokens and out[-1] in stops:
            return out, "stop"
    return out, "length"


def _plain(loaded, prompt, n=8) -> list[int]:
    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    return LLM(loaded, **ENGINE).generate([prompt], sp)[0].outputs[0].token_ids


def _summary(outs):
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs]


@pytest.mark.parametrize("engine_kw", [dict(async_scheduling=False), dict(),
                                       dict(num_scheduler_steps=4)],
                         ids=["sync", "async", "multi-step"])
def test_stop_token_ids_are_masked_before_min_tokens(engine_kw):
    loaded = tiny_loaded("llama")
    params, want = [], []
    ref = LLM(loaded, **ENGINE).engine
    for j, prompt in enumerate(PROMPTS):
        plain = _plain(loaded, prompt)
        stops = {plain[0], plain[2]}  # what greedy picks first: masked, it must change
        mt, penalty = 3 + j, (1.3 if j == 1 else 1.0)
        params.append(SamplingParams(temperature=0.0, max_tokens=12, min_tokens=mt,
                                     stop_token_ids=sorted(stops), ignore_eos=True,
                                     repetition_penalty=penalty))
        want.append(_reference(ref, prompt, stops, mt, 12, penalty))
        assert want[-1][0][0] != plain[0]
        assert not stops & set(want[-1][0][:mt])
    got = LLM(loaded, **ENGINE, **engine_kw).generate(PROMPTS, params)
    assert _summary(got) == want


def test_eos_is_masked_unless_ignore_eos_and_stale_flags_do_nothing():
    base = tiny_loaded("llama")
    prompt = PROMPTS[0]
    plain = _plain(base, prompt)
    loaded = tiny_loaded("llama", eos_token_ids=(plain[0],))  # greedy's first token is EOS
    llm = LLM(loaded, **{**ENGINE, "max_num_seqs": 1})  # one slot: every request reuses it
    eos = {plain[0]}
    mt = SamplingParams(temperature=0.0, max_tokens=10, min_tokens=4)
    assert _summary(llm.generate([prompt], mt)) == [_reference(llm.engine, prompt, eos, 4, 10)]
    # Without min_tokens EOS ends it at once; with ignore_eos nothing is masked: plain greedy.
    # Both run in the slot whose row still holds the first request's stop flag.
    assert _summary(llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=10))) == [
        ([plain[0]], "stop")]
    ign = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=4, ignore_eos=True)
    assert _summary(llm.generate([prompt], ign)) == [(plain, "length")]


def test_more_stop_ids_than_one_history_call_flags(monkeypatch):
    from jaxinfer import runner, runner_slots

    for module in (runner, runner_slots):  # the program's shape and the loader's chunks
        monkeypatch.setattr(module, "STOP_IDS_PER_CALL", 16)  # (128: > tiny's vocab)
    loaded = tiny_loaded("llama")
    prompt = PROMPTS[2]
    plain = _plain(loaded, prompt)
    # The greedy token goes last, after 16 others (ids sorted): a second call flags it.
    others = [t for t in range(2, 96) if t not in plain and t < plain[0]][:21]
    assert len(others) > 16, "pick a prompt whose greedy token is a larger id"
    stops = others + [plain[0]]
    llm = LLM(loaded, **ENGINE)
    calls = []
    load = llm.engine.runner.load_history
    monkeypatch.setattr(llm.engine.runner, "load_history",
                        lambda *a: (calls.append(len(a[3])), load(*a))[1])
    sp = SamplingParams(temperature=0.0, max_tokens=6, min_tokens=6, stop_token_ids=stops,
                        ignore_eos=True)
    got = _summary(llm.generate([prompt], sp))
    assert calls == [len(stops)]
    assert got == [_reference(llm.engine, prompt, set(stops), 6, 6)]
    assert got[0][0][0] != plain[0]


def test_stop_ids_covering_the_vocabulary_are_refused_with_min_tokens():
    llm = LLM(tiny_loaded("llama"), **ENGINE)
    every = list(range(96))
    with pytest.raises(RequestError, match=r"min_tokens 2: EOS and stop_token_ids cover the "
                                           r"whole vocabulary \(96 ids\)"):
        llm.generate([PROMPTS[0]], SamplingParams(min_tokens=2, stop_token_ids=every))
    # EOS (1) is the one id left out: with ignore_eos it is not masked either, so no refusal.
    rest = every[:1] + every[2:]
    with pytest.raises(RequestError, match="cover the whole vocabulary"):
        llm.generate([PROMPTS[0]], SamplingParams(min_tokens=2, stop_token_ids=rest))
    out = llm.generate([PROMPTS[0]], SamplingParams(min_tokens=2, stop_token_ids=rest,
                                                    ignore_eos=True, temperature=0.0,
                                                    max_tokens=3))[0].outputs[0]
    assert out.token_ids[:2] == [1, 1]  # the only token left to sample before min_tokens
    assert not llm.engine.has_unfinished_requests()


def test_allowed_token_ids_restrict_greedy_and_sampled_tokens():
    """Greedy tokens are the argmax over the allowed ids (numpy reference from
    prompt_logits), with min_tokens too; sampled n = 3 samples stay inside the set; a slot
    reused by a request without the set is not restricted; ids outside the vocabulary and
    an empty set are refused by name."""
    loaded = tiny_loaded("llama")
    llm = LLM(loaded, **{**ENGINE, "max_num_seqs": 3})
    prompt = PROMPTS[1]
    plain = _plain(loaded, prompt)
    allowed = [t for t in (3, 17, 40, 41, 77, plain[1]) if t != plain[0]]
    out: list[int] = []
    for _ in range(6):  # the reference: argmax over the allowed ids
        x = llm.engine.prompt_logits(prompt + out)[-1]
        out.append(allowed[int(np.argmax(x[allowed]))])
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                        allowed_token_ids=allowed)
    assert _summary(llm.generate([prompt], sp)) == [(out, "length")]
    assert out != plain[:6]
    sampled = llm.generate([prompt], SamplingParams(temperature=1.2, max_tokens=8, n=3, seed=4,
                                                    allowed_token_ids=allowed,
                                                    ignore_eos=True))[0]
    assert all(set(c.token_ids) <= set(allowed) for c in sampled.outputs)
    assert len({tuple(c.token_ids) for c in sampled.outputs}) > 1
    free = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    assert _summary(llm.generate([prompt], free)) == [(plain, "length")]  # slots reused
    with pytest.raises(RequestError, match=r"allowed_token_ids \[96\] are not in the "
                                           r"vocabulary"):
        llm.generate([prompt], SamplingParams(allowed_token_ids=[3, 96]))
    with pytest.raises(ValueError, match="allowed_token_ids is empty"):
        SamplingParams(allowed_token_ids=[])
    with pytest.raises(RequestError, match="min_tokens 2: EOS and stop_token_ids cover "
                                           "allowed_token_ids"):  # nothing left to sample
        llm.generate([prompt], SamplingParams(allowed_token_ids=[1, 3], stop_token_ids=[3],
                                              min_tokens=2))
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("engine_kw", [dict(async_scheduling=False), dict(),
                                       dict(num_scheduler_steps=4)],
                         ids=["sync", "async", "multi-step"])
def test_logit_bias_moves_greedy_tokens_as_the_reference(engine_kw):
    """Greedy tokens equal the argmax of prompt_logits + the bias (and a repetition penalty
    after it, as vLLM v1), batched with an unbiased request whose tokens do not change; a
    slot reused without a bias is not biased; out-of-vocabulary ids and bad values are
    refused by name."""
    loaded = tiny_loaded("llama")
    llm = LLM(loaded, **{**ENGINE, **engine_kw})
    ref = LLM(loaded, **ENGINE).engine
    prompt, other = PROMPTS[0], PROMPTS[2]
    plain, plain_other = _plain(loaded, prompt), _plain(loaded, other)
    bias = {plain[0]: -3.0, plain[1]: -2.5, 17: 1.75, 40: 2.0}
    want: list[int] = []
    for _ in range(8):
        x = ref.prompt_logits(prompt + want)[-1].astype(np.float64)
        for t, v in bias.items():
            x[t] += v
        seen = np.isin(np.arange(len(x)), prompt + want)
        x[seen] = np.where(x[seen] > 0, x[seen] / 1.2, x[seen] * 1.2)
        want.append(int(np.argmax(x)))
    assert want != plain
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logit_bias=bias,
                        repetition_penalty=1.2)
    free = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    assert _summary(llm.generate([prompt, other], [sp, free])) == [(want, "length"),
                                                                   (plain_other, "length")]
    assert _summary(llm.generate([prompt], free)) == [(plain, "length")]  # slots reused
    with pytest.raises(RequestError, match=r"logit_bias \[200\] are not in the vocabulary"):
        llm.generate([prompt], SamplingParams(logit_bias={3: 1.0, 200: -1.0}))
    with pytest.raises(ValueError, match=r"logit_bias\[5\] must be finite"):
        SamplingParams(logit_bias={5: float("nan")})
    with pytest.raises(ValueError, match="logit_bias keys must be token ids"):
        SamplingParams(logit_bias={"5": 1.0})
    with pytest.raises(ValueError, match="logit_bias has 301 entries; at most 300"):
        SamplingParams(logit_bias=dict.fromkeys(range(301), 1.0))
    assert SamplingParams(logit_bias={}).logit_bias is None
    with pytest.raises(ValueError, match=r"logit_bias\[5\] must be in \[-10000, 10000\]"):
        SamplingParams(logit_bias={5: 3e38})  # would tie / overflow in the float32 sampler
    with pytest.raises(ValueError, match=r"logit_bias\[5\] must fit float32"):
        SamplingParams(logit_bias={5: 10**400})  # (an OverflowError before)
    assert not llm.engine.has_unfinished_requests()


def test_a_request_keeps_its_own_checked_copy_of_the_sampling_params():
    """Editing a SamplingParams after add_request changes neither that request nor skips the
    checks of the next one (the engine kept the caller's object: the first request came out
    with the second's bias; a bad value set on the object reached step())."""
    llm = LLM(tiny_loaded("llama"), **ENGINE)
    eng, prompt = llm.engine, PROMPTS[0]
    plain = _plain(tiny_loaded("llama"), prompt, 5)
    sp = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True,
                        logit_bias={plain[0]: 100.0})
    first = eng.add_request(prompt, sp)
    sp.logit_bias[plain[0]] = -100.0  # the caller reuses its object
    sp.logit_bias[40] = 100.0
    second = eng.add_request(prompt, sp)
    outs = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o.outputs[0].token_ids
    assert outs[first] == [plain[0]] * 5 and outs[second] == [40] * 5
    sp.logit_bias = {-5: 1.0}
    with pytest.raises(RequestError, match="logit_bias keys must be token ids"):
        eng.add_request(prompt, sp)
    sp.logit_bias = {3: float("nan")}
    with pytest.raises(RequestError, match=r"logit_bias\[3\] must be finite"):
        eng.add_request(prompt, sp)
    assert not eng.has_unfinished_requests()
