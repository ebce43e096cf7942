"""Sampling through the engine on a tiny random model (CPU): 8 parameter sets in one compiled
step, seeds independent of batch / bucket / timing / preemption, penalties and logprobs
against a numpy reference built from ``prompt_logits``, prompt logprobs, stop strings."""

from __future__ import annotations

import numpy as np
import pytest

from jaxinfer.engine import RequestError
from jaxinfer.llm import LLM
from jaxinfer.sampling_params import ParameterError, SamplingParams
from tests.conftest import tiny_loaded

V = 96

EIGHT = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.8, top_k=5),
    SamplingParams(temperature=1.0, top_p=0.7),
    SamplingParams(temperature=1.2, min_p=0.1),
    SamplingParams(temperature=0.0, repetition_penalty=1.3),
    SamplingParams(temperature=0.9, presence_penalty=0.5, frequency_penalty=0.3, logprobs=3),
    SamplingParams(temperature=0.7, top_k=10, top_p=0.9, min_p=0.05, repetition_penalty=1.1,
                   logprobs=0),
    SamplingParams(temperature=1.5, frequency_penalty=-0.5, prompt_logprobs=2),
]


def _with(sp: SamplingParams, **kw) -> SamplingParams:
    d = {k: getattr(sp, k) for k in sp.__dataclass_fields__}
    d.update(kw)
    return SamplingParams(**d)


def _eight(seed0: int, max_tokens: int = 6) -> list[SamplingParams]:
    return [_with(sp, seed=seed0 + i, max_tokens=max_tokens, ignore_eos=True)
            for i, sp in enumerate(EIGHT)]


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    lens = [3, 5, 7, 8, 9, 12, 4, 6][:n]
    return [rng.integers(2, V, size=L).tolist() for L in lens]


def _llm(tokenizer=None, **kw) -> LLM:
    args = dict(max_model_len=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    args.update(kw)
    loaded = tiny_loaded("llama")
    loaded.tokenizer = tokenizer
    return LLM(loaded, **args)


def _ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return x - (x.max(-1, keepdims=True) + np.log(np.exp(x - x.max(-1, keepdims=True)).sum(
        -1, keepdims=True)))


def _np_penalized(logits, prompt, out, sp: SamplingParams) -> np.ndarray:
    x = logits.astype(np.float64).copy()
    counts = np.bincount(np.asarray(out, int), minlength=len(x)).astype(np.float64)
    seen = (counts > 0) | np.isin(np.arange(len(x)), prompt)
    r = sp.repetition_penalty
    x[seen] = np.where(x[seen] > 0, x[seen] / r, x[seen] * r)
    return x - sp.frequency_penalty * counts - sp.presence_penalty * (counts > 0)


def test_eight_parameter_sets_share_one_compiled_step():
    llm = _llm()
    runner = llm.engine.runner
    steps = []
    launch = runner.launch

    # Every sample step is dispatched by runner.launch (runner.execute calls it; async
    # scheduling calls it directly).
    def spy(inputs, token_ids=None, before_sample=None):
        steps.append(("sample", inputs.bucket, inputs.sampling))
        return launch(inputs, token_ids, before_sample)

    runner.launch = spy
    llm.generate(_prompts(8, 1), _eight(100))  # warm-up: every program these shapes need
    built = runner.num_compilations + runner.num_loaded
    assert built > 0
    steps.clear()
    outs = llm.generate(_prompts(8, 2), _eight(200)[::-1])  # new prompts, params, seeds
    assert runner.num_compilations + runner.num_loaded == built
    # A decode step ran all 8 requests, each row with its own parameters.
    full = [sa for mode, b, sa in steps if mode == "sample" and b.kind == "decode"
            and b.num_seqs == 8 and np.all(sa.seeds[:, 0] >= 200)]
    assert full
    rows = {(float(t), int(k), float(p), float(m), float(r), float(pr), float(f))
            for t, k, p, m, r, pr, f in zip(*full[0][:7])}
    assert len(rows) == 8
    assert all(len(o.outputs[0].token_ids) == 6 for o in outs)
    assert outs[2].outputs[0].logprobs is not None and len(outs[2].outputs[0].logprobs) == 6
    assert outs[0].prompt_logprobs is not None and len(outs[0].prompt_logprobs) == 3


def test_new_parameters_compile_nothing_after_greedy_warm_up():
    """Each step runs the sampler variant its parameters need (runner.py); the first program
    of a bucket builds them all. After a greedy warm-up, a batch of 8 requests with 8
    different parameter sets runs several variants and compiles nothing."""
    llm = _llm()
    runner = llm.engine.runner
    # Rows end one after another, so later steps need fewer parts (the same buckets each run).
    lens = [6, 3, 4, 5, 6, 2, 2, 6]
    greedy = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lens]
    # One repetition penalty: it loads the penalty-history program, not a sampler program.
    greedy[4] = _with(greedy[4], repetition_penalty=1.2)
    llm.generate(_prompts(8, 1), greedy)
    built = runner.num_compilations + runner.num_loaded
    used, sampler = [], runner.sampler

    def spy(S, variant):
        used.append(variant)
        return sampler(S, variant)

    runner.sampler = spy
    params = [_with(sp, prompt_logprobs=None, max_tokens=n)  # no logits program
              for sp, n in zip(_eight(200), lens)]
    outs = llm.generate(_prompts(8, 2), params)
    assert runner.num_compilations + runner.num_loaded == built
    # The mix has top-p-only rows beside top-k rows: their searches take the vocabulary
    # (sampling.SamplerNeeds.full_search), hence "top_k_top_p_full".
    assert set(used) == {"full", "top_k_top_p_full", "top_p", "temperature"}, used
    assert [len(o.outputs[0].token_ids) for o in outs] == lens


def test_seeded_outputs_do_not_depend_on_batch_bucket_timing_or_preemption():
    prompts, params = _prompts(8, 3), _eight(300, max_tokens=10)
    alone = [_ids(_llm().generate([p], sp))[0] for p, sp in zip(prompts, params)]
    assert len({tuple(a) for a in alone}) > 4
    together = _ids(_llm().generate(prompts, params))
    assert together == alone
    # Scheduled later, joined by others mid-flight, in a different order and bucket.
    llm = _llm()
    eng = llm.engine
    rids = {eng.add_request(prompts[i], params[i]): i for i in (5, 2)}
    for _ in range(3):
        eng.step()
    rids.update({eng.add_request(prompts[i], params[i]): i for i in (0, 7, 1, 6, 4, 3)})
    final = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                final[rids[o.request_id]] = o.outputs[0].token_ids
    assert [final[i] for i in range(8)] == alone
    # 20 usable pages of 4 tokens cannot hold all 8: preemption re-prefills and reloads the
    # penalty state of re-admitted requests.
    small = _llm(num_kv_pages=21)
    preempted = []
    schedule = small.engine.scheduler.schedule

    def spy():
        out = schedule()
        preempted.extend(out.preempted)
        return out

    small.engine.scheduler.schedule = spy
    assert _ids(small.generate(prompts, params)) == alone
    assert preempted


def _reference(prompt, sp: SamplingParams, tokens: list[int] | None = None):
    """Token-by-token numpy reference from full-sequence logits (prompt_logits): greedy with
    penalties when ``tokens`` is None, else the logprobs of the given tokens."""
    ref = _llm().engine
    out: list[int] = []
    lps = []
    for i in range(sp.max_tokens if tokens is None else len(tokens)):
        logits = ref.prompt_logits(prompt + out)[-1]
        tok = (int(np.argmax(_np_penalized(logits, prompt, out, sp))) if tokens is None
               else tokens[i])
        lps.append(_log_softmax(logits))
        out.append(tok)
    return out, lps


@pytest.mark.parametrize("kw", [
    dict(repetition_penalty=2.5), dict(repetition_penalty=0.5),
    dict(presence_penalty=1.5, frequency_penalty=0.7), dict(presence_penalty=2.0),
    dict(repetition_penalty=1.4, presence_penalty=-0.5, frequency_penalty=2.0),
])
def test_greedy_penalties_and_logprobs_match_numpy(kw):
    prompt = _prompts(6, 4)[5]
    sp = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=4, **kw)
    want, lps = _reference(prompt, sp)
    plain = _ids(_llm().generate([prompt], SamplingParams(temperature=0.0, max_tokens=10,
                                                          ignore_eos=True)))[0]
    assert want != plain, "the penalty should change this greedy output"
    llm = _llm()
    llm.generate([prompt[:5]], SamplingParams(temperature=0, max_tokens=2))  # cache 1 page
    out = llm.generate([prompt], sp)[0]
    assert out.metrics["num_cached_tokens"] > 0  # the history came partly from the cache
    c = out.outputs[0]
    assert c.token_ids == want
    for i, (tok, entry) in enumerate(zip(c.token_ids, c.logprobs)):
        top = np.argsort(-lps[i])[:4]
        assert next(iter(entry)) == tok and set(entry) == {tok, *top.tolist()}
        for t, v in entry.items():
            assert v == pytest.approx(lps[i][t], abs=2e-4)
    assert c.cumulative_logprob == pytest.approx(sum(lps[i][t] for i, t in
                                                     enumerate(c.token_ids)), abs=1e-3)


def test_sampled_logprobs_and_prompt_logprobs_match_numpy():
    prompt = _prompts(6, 5)[5]
    sp = SamplingParams(temperature=1.3, top_k=30, seed=7, max_tokens=6, ignore_eos=True,
                        logprobs=2, prompt_logprobs=3)
    llm = _llm(max_num_batched_tokens=8)  # the 12-token prompt scores in two chunks
    first = llm.generate([prompt], sp)[0]
    c = first.outputs[0]
    _, lps = _reference(prompt, sp, c.token_ids)
    for i, tok in enumerate(c.token_ids):
        assert c.logprobs[i][tok] == pytest.approx(lps[i][tok], abs=2e-4)
    ref = _log_softmax(_llm().engine.prompt_logits(prompt))
    pl = first.prompt_logprobs
    assert pl[0] is None and len(pl) == len(prompt)
    for i in range(1, len(prompt)):
        top = np.argsort(-ref[i - 1])[:3]
        assert next(iter(pl[i])) == prompt[i] and set(pl[i]) == {prompt[i], *top.tolist()}
        for t, v in pl[i].items():
            assert v == pytest.approx(ref[i - 1, t], abs=2e-4)
    # Again from the prefix cache: same prompt logprobs, same tokens (scoring wrote nothing).
    again = llm.generate([prompt], sp)[0]
    assert again.metrics["num_cached_tokens"] > 0
    assert again.outputs[0].token_ids == c.token_ids
    for a, b in zip(again.prompt_logprobs[1:], pl[1:]):
        assert a.keys() == b.keys()
        assert np.allclose(list(a.values()), list(b.values()), atol=1e-4)


def test_stop_strings_end_the_request(smollm_tokenizer):
    # The tiny model's ids 17..95 are single characters of SmolLM2's vocabulary.
    tok = smollm_tokenizer
    prompt = [40, 50, 60, 70, 80]
    base = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    full = _llm(tok).generate([prompt], base)[0].outputs[0]
    ids, text = full.token_ids, full.text
    assert text == tok.decode(ids) and len(text) >= 12 and full.finish_reason == "length"
    for stop in (text[5:8], text[:2], text[-3:]):  # multi-token, at the very start, at the end
        j = next(k for k in range(len(ids)) if stop in tok.decode(ids[:k + 1]))
        llm = _llm(tok)
        out = llm.generate([prompt], _with(base, stop=["zzzz-never", stop]))[0].outputs[0]
        assert out.text == text[:text.find(stop)] and out.token_ids == ids[:j + 1]
        assert (out.finish_reason, out.stop_reason) == ("stop", stop)
        assert not llm.engine.has_unfinished_requests()
        assert llm.engine.scheduler.block_manager.num_used_pages == 0  # pages freed at once
        assert not llm.engine._slots.mapping  # its sampling slot too
        kept = llm.generate([prompt], _with(base, stop=[stop], include_stop_str_in_output=True))
        assert kept[0].outputs[0].text == text[:text.find(stop) + len(stop)]
    # Streaming: texts while running never show a partial stop string and never shrink.
    llm = _llm(tok)
    eng = llm.engine
    stop = text[9:12]
    rid = eng.add_request(prompt, _with(base, stop=[stop]))
    seen = []
    while eng.has_unfinished_requests():
        seen += [o.outputs[0].text for o in eng.step() if o.request_id == rid]
    assert seen[-1] == text[:text.find(stop)]
    assert all(seen[-1].startswith(s) for s in seen)


def test_bad_parameters_and_stop_strings_without_tokenizer():
    with pytest.raises(RequestError, match="stop strings need a tokenizer"):
        _llm().generate([[3, 4]], SamplingParams(stop=["x"]))
    for kw, field in [(dict(n=65), "n"), (dict(min_p=1.5), "min_p"),
                      (dict(repetition_penalty=0.0), "repetition_penalty"),
                      (dict(presence_penalty=2.5), "presence_penalty"),
                      (dict(frequency_penalty=-3), "frequency_penalty"),
                      (dict(logprobs=21), "logprobs"), (dict(prompt_logprobs=-1),
                                                        "prompt_logprobs"),
                      (dict(stop=[""]), "stop"), (dict(stop=[3]), "stop"),
                      (dict(skip_special_tokens=1), "skip_special_tokens"),
                      (dict(temperature=float("nan")), "temperature")]:
        with pytest.raises(ParameterError, match=field):
            SamplingParams(**kw)


@pytest.mark.slow
def test_real_model_stop_string_and_logprobs():
    from jaxinfer.loading import CheckpointError, load_model

    try:
        loaded = load_model("smollm2-135m")
    except CheckpointError as e:
        pytest.skip(str(e))
    llm = LLM(loaded, max_model_len=128, max_num_seqs=2, max_num_batched_tokens=32)
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    full = llm.generate(["The capital of France is"], greedy)[0].outputs[0]
    assert full.text.startswith(" Paris.")  # models.md: greedy " Paris." ...
    out = llm.generate(["The capital of France is"],
                       _with(greedy, stop=["."], logprobs=2))[0].outputs[0]
    assert (out.text, out.finish_reason, out.stop_reason) == (" Paris", "stop", ".")
    assert out.token_ids == full.token_ids[:len(out.token_ids)]
    assert len(out.logprobs) == len(out.token_ids) and out.cumulative_logprob < 0
    # detokenize=False (vLLM's): the same tokens and logprobs, no text; stop strings refused.
    lp = llm.generate(["The capital of France is"], _with(greedy, logprobs=2))[0].outputs[0]
    bare = llm.generate(["The capital of France is"],
                        _with(greedy, logprobs=2, detokenize=False))[0].outputs[0]
    assert (bare.text, bare.token_ids, bare.logprobs) == ("", full.token_ids, lp.logprobs)
    with pytest.raises(ParameterError, match="stop strings need detokenize=True"):
        _with(greedy, stop=["."], detokenize=False)


@pytest.mark.parametrize("penalty", [1e-38, 1e-45, 5e-324, -1e-300])
def test_a_repetition_penalty_below_float32_normals_is_refused(penalty):
    """1e-38 / 1e-45 / 5e-324 became 0 in the sampler's float32 (flushed or rounded) and
    ran as "no penalty" (the sampler reads <= 0 as off); float32's smallest normal runs."""
    with pytest.raises(ParameterError, match=r"repetition_penalty must be > 0 \(at least "
                                             r"1\.175e-38"):
        SamplingParams(repetition_penalty=penalty)
    SamplingParams(repetition_penalty=float(np.finfo(np.float32).tiny))


def test_top_k_beyond_int32_keeps_every_token():
    """top_k=2**31 passed SamplingParams, then failed inside step() (OverflowError filling
    the int32 row) and lost the batch; vLLM reads a top_k past the vocabulary as "all"."""
    llm = _llm()
    prompts = _prompts(3, seed=7)
    outs = {}
    for k in (-1, V + 1, 2**31, 10**30):
        sp = SamplingParams(temperature=1.0, top_k=k, seed=11, max_tokens=6, ignore_eos=True)
        outs[k] = _ids(llm.generate(prompts, sp))
    assert outs[V + 1] == outs[2**31] == outs[10**30] == outs[-1]
    assert len({tuple(o) for o in outs[-1]}) == 3  # the rows differ: a real comparison
