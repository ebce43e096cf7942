"""``SamplingParams.n > 1`` through the engine (tiny random models, CPU): one prompt prefill,
samples that share its pages (copy-on-write of a partial last page), per-sample seeds,
outputs, preemption, and no compilation after warm-up."""

from __future__ import annotations

import numpy as np
import pytest

from jaxinfer.engine import RequestError
from jaxinfer.llm import LLM
from jaxinfer.sampling_params import ParameterError, SamplingParams
from tests.conftest import tiny_loaded

PS = 4  # page size


def _llm(family: str = "llama", **kw) -> LLM:
    args = {"max_model_len": 64, "block_size": PS, "max_num_seqs": 8, "max_num_batched_tokens": 64}
    args.update(kw)
    return LLM(tiny_loaded(family), **args)


def _prompts(seed: int = 0) -> list[list[int]]:
    """Prompts whose last page is partial when the samples fork (7, 14 tokens), full (5, 9:
    the tokens before the last end a page) and a single token."""
    rng = np.random.default_rng(seed)
    return [rng.integers(2, 96, size=n).tolist() for n in (7, 5, 14, 1, 9)]


def _greedy(n: int = 1, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, n=n, **kw)


def _sampled(n: int = 1, **kw) -> SamplingParams:
    return SamplingParams(temperature=1.0, top_k=40, max_tokens=8, ignore_eos=True, n=n, **kw)


def _samples(out) -> list[list[int]]:
    assert [c.index for c in out.outputs] == list(range(len(out.outputs)))
    return [c.token_ids for c in out.outputs]


def test_greedy_samples_equal_each_other_and_n1(tiny_family):
    prompts = _prompts()
    llm = _llm(tiny_family)
    ref = [o.outputs[0].token_ids for o in llm.generate(prompts, _greedy())]
    assert len({tuple(t) for t in ref}) > 1
    outs = llm.generate(prompts, _greedy(3))
    for out, r in zip(outs, ref):
        assert out.finished and _samples(out) == [r] * 3
        assert all(c.finish_reason == "length" for c in out.outputs)


def test_seeded_samples_reproducible_alone_and_in_a_batch():
    prompts = _prompts(1)
    sp = _sampled(2, seed=11)
    alone = _samples(_llm().generate([prompts[0]], sp)[0])
    assert alone[0] != alone[1]
    # Sample i draws with seed + i: it is sample 0 of a request seeded seed + i.
    shifted = _llm().generate([prompts[0]], _sampled(1, seed=12))[0]
    assert _samples(shifted)[0] == alone[1]
    batch = [prompts[1], prompts[0], prompts[2], prompts[3], prompts[0]]
    mixed = _llm().generate(batch, [_sampled(3), sp, _greedy(2), _sampled(1, seed=5),
                                    _sampled(2, seed=11, top_p=0.9)])
    assert _samples(mixed[1]) == alone
    assert _samples(mixed[4]) != alone  # other parameters, same seed: another draw


def test_unseeded_samples_differ():
    out = _llm().generate([_prompts(2)[2]], _sampled(4))[0]
    assert len({tuple(t) for t in _samples(out)}) == 4


def _record_plans(sched) -> list[tuple[bool, int, int]]:
    """(prefill?, tokens, page copies) of every plan ``sched`` makes from now on."""
    plans, plan = [], sched.schedule

    def recording():
        out = plan()
        plans.append((out.is_prefill, out.num_batched_tokens, len(out.page_copies)))
        return out

    sched.schedule = recording
    return plans


def test_prompt_pages_are_shared_and_prefilled_once():
    """After the fork a 14-token prompt's 3 full pages are held once (reference count 4) and
    each of 4 samples has its own last page; 4 separate requests hold 4 pages each. The
    prompt is computed once: 13 tokens in prefill, then 4 decode rows for its last token."""
    prompt = _prompts(3)[2]
    for caching in (True, False):
        llm = _llm(enable_prefix_caching=caching)
        eng, bm = llm.engine, llm.engine.scheduler.block_manager
        rid = eng.add_request(prompt, _greedy(4))
        plans = _record_plans(eng.scheduler)
        eng.step()
        eng.step()
        assert plans == [(True, 13, 0), (False, 4, 3)]
        group = eng.scheduler.get(rid).group
        assert bm.num_used_pages == 3 + 4
        assert [bm.ref_count[p] for p in group.samples[0].block_table[:3]] == [4, 4, 4]
        assert len({s.block_table[3] for s in group.samples}) == 4
        while eng.has_unfinished_requests():
            eng.step()
        assert bm.num_used_pages == 0
        sep = _llm(enable_prefix_caching=caching).engine
        for _ in range(4):
            sep.add_request(prompt, _greedy())
        sep.step()  # all four prefilled at once: nothing to share yet
        assert sep.scheduler.block_manager.num_used_pages == 4 * 4


def test_no_compilation_after_warmup_with_samples():
    llm = _llm()
    runner = llm.engine.runner
    params = [_greedy(3), _sampled(2, seed=1), _greedy(), _sampled(4), _greedy(2)]
    llm.generate(_prompts(4), params)
    assert ("copy", runner.copy_bucket) in runner.compiled_buckets
    n_compiled, n_loaded = runner.num_compilations, runner.num_loaded
    llm.generate(_prompts(5), params)
    assert (runner.num_compilations, runner.num_loaded) == (n_compiled, n_loaded)


def test_preemption_keeps_sample_outputs():
    prompts = _prompts(6)
    params = [_greedy(3), _sampled(3, seed=21), _greedy(), _sampled(2, seed=4), _greedy(2)]
    ref = [_samples(o) for o in _llm().generate(prompts, params)]
    small = _llm(num_kv_pages=14)  # 13 usable pages for 11 sequences: must preempt
    sched = small.engine.scheduler
    plan, preempted = sched.schedule, []

    def counting():
        out = plan()
        preempted.extend(out.preempted)
        return out

    sched.schedule = counting  # type: ignore[method-assign]
    assert [_samples(o) for o in small.generate(prompts, params)] == ref
    assert any(s.sample_index > 0 for s in preempted)
    assert sched.block_manager.num_used_pages == 0


def test_penalties_logprobs_and_prompt_logprobs_per_sample():
    """Each sample has its own penalty row (loaded with the prompt at the fork), its own
    logprobs; prompt logprobs are the request's, computed once."""
    prompt = _prompts(7)[2]
    kw = {"repetition_penalty": 1.3, "frequency_penalty": 0.5, "logprobs": 2, "prompt_logprobs": 1}
    llm = _llm()
    one = llm.generate([prompt], _greedy(**kw))[0]
    three = llm.generate([prompt], _greedy(3, **kw))[0]
    assert _samples(three) == [one.outputs[0].token_ids] * 3
    for c in three.outputs:
        assert len(c.logprobs) == 8
        np.testing.assert_allclose(c.cumulative_logprob, one.outputs[0].cumulative_logprob,
                                   rtol=1e-4)
    assert three.prompt_logprobs is not None and len(three.prompt_logprobs) == len(prompt)
    for a, b in zip(three.prompt_logprobs[1:], one.prompt_logprobs[1:]):
        assert list(a) == list(b)


def test_samples_finish_alone_request_finishes_with_the_last():
    eng = _llm().engine
    rid = eng.add_request(_prompts(8)[2], SamplingParams(temperature=1.0, max_tokens=12,
                                                         n=4, seed=3, stop_token_ids=[7, 9,
                                                                                      11]))
    seen_partial = False
    while True:
        outs = [o for o in eng.step() if o.request_id == rid]
        if not outs:
            continue
        out = outs[0]
        assert len(out.outputs) == 4
        done = [c.finish_reason is not None for c in out.outputs]
        assert out.finished == all(done)
        seen_partial |= any(done) and not all(done)
        if out.finished:
            break
    assert seen_partial, "the samples should finish at different steps"
    assert not eng.has_unfinished_requests() and not eng._slots.mapping
    assert eng.scheduler.block_manager.num_used_pages == 0


def test_abort_frees_every_sample():
    eng = _llm().engine
    rid = eng.add_request(_prompts(9)[2], _greedy(4))
    for _ in range(3):
        eng.step()
    assert len(eng.scheduler.get(rid).group.samples) == 4
    assert eng.abort_request(rid) and not eng.has_unfinished_requests()
    assert eng.scheduler.block_manager.num_used_pages == 0 and not eng._slots.mapping


@pytest.mark.parametrize("n", [0, 65, 1.5, True])
def test_bad_n_names_the_field(n):
    with pytest.raises(ParameterError, match=r"^n must be"):
        SamplingParams(n=n)


def test_more_samples_than_max_num_seqs_is_rejected():
    llm = _llm(max_num_seqs=4)
    with pytest.raises(RequestError, match="n = 5 samples.*max_num_seqs = 4"):
        llm.generate([[3, 4, 5]], _greedy(5))
    assert not llm.engine.has_unfinished_requests()
