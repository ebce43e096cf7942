"""Async scheduling (EngineConfig.async_scheduling): outputs equal the synchronous engine's,
request by request, and the pipelined path is really taken."""

from __future__ import annotations

import numpy as np
import pytest

from jaxinfer.llm import LLM
from jaxinfer.sampling_params import SamplingParams
from tests.conftest import tiny_loaded

ENGINE = dict(max_model_len=64, block_size=4, max_num_seqs=6, max_num_batched_tokens=32,
              max_prefill_seqs=4, decode_buckets=(1, 2, 4, 8))


def _workload(seed: int, num: int = 10, min_tokens: float = 0.3, allowed: float = 0.15,
              bias: float = 0.2) -> tuple[list[list[int]], list[SamplingParams]]:
    """Mixed prompt lengths, max_tokens, greedy and seeded sampling, stop ids, ignore_eos,
    n > 1, logprobs, penalties, min_tokens, allowed_token_ids and logit_bias (on those
    shares of the requests), shared prefixes (prefix caching)."""
    rng, mrng = np.random.default_rng(seed), np.random.default_rng(seed + 1000)
    brng = np.random.default_rng(seed + 2000)  # (own generator: the rest unchanged)
    shared = rng.integers(2, 96, 9).tolist()
    prompts, params = [], []
    for i in range(num):
        p = rng.integers(2, 96, int(rng.integers(1, 14))).tolist()
        prompts.append(shared + p if rng.random() < 0.4 else p)
        kw: dict = {"max_tokens": int(rng.integers(1, 12)), "seed": int(rng.integers(1 << 30))}
        r = rng.random()
        kw["temperature"] = 0.0 if r < 0.35 else float(rng.uniform(0.5, 1.5))
        if rng.random() < 0.5:
            kw["ignore_eos"] = True
        if rng.random() < 0.4:
            kw["stop_token_ids"] = rng.integers(2, 96, 4).tolist()
        if rng.random() < 0.3:
            kw["logprobs"] = int(rng.integers(0, 3))
        if rng.random() < 0.2:
            kw["n"] = int(rng.integers(2, 4))
        if rng.random() < 0.2:
            kw.update(repetition_penalty=1.3, presence_penalty=0.4)
        if rng.random() < 0.2:
            kw["top_k"], kw["top_p"] = 8, 0.9
        if mrng.random() < min_tokens:  # stop tokens masked until then (own generator: the
            kw["min_tokens"] = int(mrng.integers(1, kw["max_tokens"] + 1))  # rest unchanged)
        if mrng.random() < allowed:  # a few ids, EOS (1) among them or not
            kw["allowed_token_ids"] = sorted({int(t) for t in mrng.integers(1, 96, 12)})
        if brng.random() < bias:  # a few ids pushed up or down enough to change tokens
            ids = brng.choice(np.arange(1, 96), int(brng.integers(1, 9)), replace=False)
            kw["logit_bias"] = {int(t): float(v) for t, v in zip(ids, brng.uniform(-6, 6,
                                                                                  len(ids)))}
        params.append(SamplingParams(**kw))
    return prompts, params


def _summary(outs) -> list:
    return [(o.request_id, [(c.index, c.token_ids, c.finish_reason, c.cumulative_logprob,
                             c.logprobs) for c in o.outputs]) for o in outs]


def _run(loaded, prompts, params, **kw):
    llm = LLM(loaded, **{**ENGINE, **kw})
    return llm, llm.generate(prompts, params)


@pytest.mark.parametrize("seed, pages", [(0, None), (1, 14), (2, None), (4, 16)])
def test_async_outputs_equal_sync(seed, pages):
    """Random workloads (a tiny pool: preemption) give the same tokens, logprobs and finish
    reasons with async scheduling as without, and some steps were pipelined.

    Which steps can pipeline depends on the sampled tokens (EOS and stop tokens end rows):
    with the hash Gumbel noise (sampling.DRAW_METHOD, e9b3bd6) workload 3 on 16 pages (3
    preemptions, requests of 2-11 tokens) pipelines no step, so the 16-page case runs
    workload 4 (5 preemptions, 4 pipelined steps)."""
    loaded = tiny_loaded("llama")
    prompts, params = _workload(seed)
    extra = {} if pages is None else {"num_kv_pages": pages}
    _, sync = _run(loaded, prompts, params, async_scheduling=False, **extra)
    llm, asy = _run(loaded, prompts, params, async_scheduling=True, **extra)
    assert _summary(asy) == _summary(sync)
    assert llm.engine.num_pipelined_steps > 0
    assert llm.engine.scheduler.block_manager.num_used_pages == 0  # pages ahead were freed


def test_lag_never_exceeds_max_tokens_and_wastes_one_row_after_eos():
    """Greedy requests that stop on a stop token mid-stream: same outputs, no output past
    max_tokens, and the pipeline keeps running after a sequence stops."""
    loaded = tiny_loaded("llama")
    prompts = [[5, 6, 7], [9, 10], [11, 12, 13, 14], [20]]
    _, ref = _run(loaded, prompts, SamplingParams(temperature=0.0, max_tokens=20,
                                                  ignore_eos=True), async_scheduling=False)
    stops = [o.outputs[0].token_ids[i] for o, i in zip(ref, (3, 6, 9, 12))]
    params = [SamplingParams(temperature=0.0, max_tokens=m, stop_token_ids=[t])
              for m, t in zip((20, 5, 20, 15), stops)]
    _, sync = _run(loaded, prompts, params, async_scheduling=False)
    llm, asy = _run(loaded, prompts, params, async_scheduling=True)
    assert _summary(asy) == _summary(sync)
    assert all(len(c.token_ids) <= p.max_tokens for o, p in zip(asy, params) for c in o.outputs)
    assert {o.outputs[0].finish_reason for o in asy} == {"stop", "length"}
    assert llm.engine.num_pipelined_steps >= 10


def test_streamed_steps_equal_sync():
    """Step by step (the server's loop), the outputs each step returns are the same. (This
    workload never has a sequence stop while others wait with every place taken: such a
    stop moves a waiting request's admission one step later under async scheduling, see
    ``test_waiting_queue_pipelines_with_outputs_equal_sync``.)"""
    loaded = tiny_loaded("llama")
    prompts, params = _workload(5, num=6)

    def stream(**kw):
        llm = LLM(loaded, **ENGINE, **kw)
        for i, (p, sp) in enumerate(zip(prompts, params)):
            llm.engine.add_request(p, sp, request_id=i)
        steps = []
        while llm.engine.has_unfinished_requests():
            steps.append(_summary(llm.engine.step()))
        return llm, steps

    _, sync = stream(async_scheduling=False)
    llm, asy = stream(async_scheduling=True)
    assert asy == sync
    assert llm.engine.num_pipelined_steps > 0


def _assert_outputs_close(asy, sync):
    """Tokens and finish reasons equal; logprobs equal to float32 rounding (a request
    batched with other requests, in another batch bucket, rounds differently)."""
    def exact(outs):
        return [(o.request_id, [(c.index, c.token_ids, c.finish_reason) for c in o.outputs])
                for o in outs]

    assert exact(asy) == exact(sync)
    for a, b in zip(asy, sync):
        for ca, cb in zip(a.outputs, b.outputs):
            if cb.cumulative_logprob is None:
                assert ca.cumulative_logprob is None
            else:
                assert ca.cumulative_logprob == pytest.approx(cb.cumulative_logprob, abs=1e-4)
            assert (ca.logprobs is None) == (cb.logprobs is None)
            for la, lb in zip(ca.logprobs or [], cb.logprobs or []):
                assert la.keys() == lb.keys()
                assert [la[t] for t in lb] == pytest.approx(list(lb.values()), abs=1e-5)


@pytest.mark.parametrize("seed, num, pages", [(12, 24, None), (13, 30, 24)])
def test_waiting_queue_pipelines_with_outputs_equal_sync(seed, num, pages):
    """More requests than max_num_seqs places (a waiting queue while every place is taken;
    with a tiny pool also preemption and page-blocked admission): random prompts with
    shared prefixes, greedy and seeded sampling, EOS, stop tokens, n > 1, penalties. Steps
    pipeline while requests wait (the synchronous scheduler could admit none of them), rows
    stop there by EOS or a stop token (async admits the waiting request one step late), and
    every request's outputs equal the synchronous engine's."""
    loaded = tiny_loaded("llama")
    prompts, params = _workload(seed, num, min_tokens=0.0, allowed=0.0, bias=0.0)  # early stops
    # are the point here
    extra = {"max_num_seqs": 4} | ({} if pages is None else {"num_kv_pages": pages})
    _, sync = _run(loaded, prompts, params, async_scheduling=False, **extra)
    llm = LLM(loaded, **{**ENGINE, **extra}, async_scheduling=True)
    eng = llm.engine
    launch_next, step, post = eng._launch_next, eng.step, eng.scheduler.postprocess
    seen = {"waiting": 0, "stops": 0, "pipelined_now": False, "finished": []}

    def spy_postprocess(out, tokens):  # the samples each step finishes (whatever outputs
        new, finished = post(out, tokens)  # generate's final_only requests return)
        seen["finished"] = list(finished)
        return new, finished

    def spy_launch_next(cur):  # the next step is dispatched before ``cur`` is read back
        waiting = bool(eng.scheduler.waiting)
        nxt = launch_next(cur)
        seen["pipelined_now"] = nxt is not None and waiting
        seen["waiting"] += seen["pipelined_now"]
        return nxt

    def spy_step():
        seen["pipelined_now"], seen["finished"] = False, []
        outs = step()
        if seen["pipelined_now"] and any(s.finish_reason == "stop" for s in seen["finished"]):
            seen["stops"] += 1  # a row of ``cur`` stopped: its place is refilled a step late
        return outs

    eng._launch_next, eng.step = spy_launch_next, spy_step
    eng.scheduler.postprocess = spy_postprocess
    asy = llm.generate(prompts, params)
    _assert_outputs_close(asy, sync)
    assert len(prompts) > extra["max_num_seqs"]
    assert seen["waiting"] > 0 and eng.num_pipelined_steps >= seen["waiting"]
    assert seen["stops"] > 0
    assert eng.scheduler.block_manager.num_used_pages == 0


@pytest.mark.parametrize("extra", [{"num_kv_pages": 18}, {"max_num_seqs": 4},
                                   {"num_kv_pages": 20, "enable_prefix_caching": False}])
def test_admission_blocked_is_the_synchronous_decision(extra):
    """``engine_async.admission_blocked``, asked about a decode step of every running
    sequence (none ending by length) while requests wait, before the step is read back,
    predicts the synchronous scheduler's next plan whenever no row of the step stops:
    blocked -> a decode step (nothing admitted), not blocked -> a prefill (admission)."""
    from jaxinfer.engine_async import admission_blocked

    loaded = tiny_loaded("llama")
    tally = {True: 0, False: 0}
    for seed in range(2):
        llm = LLM(loaded, **{**ENGINE, **extra, "async_scheduling": False})
        sch = llm.engine.scheduler
        postprocess, schedule = sch.postprocess, sch.schedule
        pred: list = [None]

        def spy_postprocess(out, sampled, sch=sch, postprocess=postprocess, pred=pred):
            p = None
            if (not out.is_prefill and out.chunks and sch.waiting
                    and len(out.chunks) == len(sch.running)
                    and all(c.num_tokens == 1 and c.samples and not c.seq.fork_pending
                            and c.start + 1 == c.seq.num_tokens
                            and c.seq.num_output_tokens + 1 < c.seq.sampling_params.max_tokens
                            and c.seq.num_tokens + 1 < sch.cfg.max_model_len
                            for c in out.chunks)):
                p = admission_blocked(sch, list(out.chunks))
            res = postprocess(out, sampled)
            pred[0] = None if res.finished else p
            return res

        def spy_schedule(schedule=schedule, pred=pred):
            p, pred[0] = pred[0], None
            out = schedule()
            if p is not None:
                assert out.is_prefill is not p
                tally[p] += 1
            return out

        sch.postprocess, sch.schedule = spy_postprocess, spy_schedule
        llm.generate(*_workload(20 + seed, 30))
    assert tally[True] > 0


@pytest.mark.parametrize("command", ["generate", "chat", "serve", "compile"])
def test_cli_flag_reaches_the_engine_options(command):
    from jaxinfer import cli

    extra = ["prompt"] if command == "generate" else []
    parser = cli.build_parser()
    ns = parser.parse_args([command, "--async-scheduling", *extra])
    assert cli._engine_args(ns)["async_scheduling"] is True
    assert "async_scheduling" not in cli._engine_args(parser.parse_args([command, *extra]))
