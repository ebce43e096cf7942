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


def _workload(seed: int, num: int = 10) -> tuple[list[list[int]], list[SamplingParams]]:
    """Mixed prompt lengths, max_tokens, greedy and seeded sampling, stop ids, ignore_eos,
    n > 1, logprobs, penalties, shared prefixes (prefix caching)."""
    rng = np.random.default_rng(seed)
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
        params.append(SamplingParams(**kw))
    return prompts, params


def _summary(outs) -> list:
    return [(o.request_id, [(c.index, c.token_ids, c.finish_reason, c.cumulative_logprob,
                             c.logprobs) for c in o.outputs]) for o in outs]


def _run(loaded, prompts, params, **kw):
    llm = LLM(loaded, **ENGINE, **kw)
    return llm, llm.generate(prompts, params)


@pytest.mark.parametrize("seed, pages", [(0, None), (1, 14), (2, None), (3, 16)])
def test_async_outputs_equal_sync(seed, pages):
    """Random workloads (a tiny pool: preemption) give the same tokens, logprobs and finish
    reasons with async scheduling as without, and some steps were pipelined."""
    loaded = tiny_loaded("llama")
    prompts, params = _workload(seed)
    extra = {} if pages is None else {"num_kv_pages": pages}
    _, sync = _run(loaded, prompts, params, **extra)
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
                                                  ignore_eos=True))
    stops = [o.outputs[0].token_ids[i] for o, i in zip(ref, (3, 6, 9, 12))]
    params = [SamplingParams(temperature=0.0, max_tokens=m, stop_token_ids=[t])
              for m, t in zip((20, 5, 20, 15), stops)]
    _, sync = _run(loaded, prompts, params)
    llm, asy = _run(loaded, prompts, params, async_scheduling=True)
    assert _summary(asy) == _summary(sync)
    assert all(len(c.token_ids) <= p.max_tokens for o, p in zip(asy, params) for c in o.outputs)
    assert {o.outputs[0].finish_reason for o in asy} == {"stop", "length"}
    assert llm.engine.num_pipelined_steps >= 10


def test_streamed_steps_equal_sync():
    """Step by step (the server's loop), the outputs each step returns are the same."""
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

    _, sync = stream()
    llm, asy = stream(async_scheduling=True)
    assert asy == sync
    assert llm.engine.num_pipelined_steps > 0


@pytest.mark.parametrize("command", ["generate", "chat", "serve", "compile"])
def test_cli_flag_reaches_the_engine_options(command):
    from jaxinfer import cli

    extra = ["prompt"] if command == "generate" else []
    parser = cli.build_parser()
    ns = parser.parse_args([command, "--async-scheduling", *extra])
    assert cli._engine_args(ns)["async_scheduling"] is True
    assert "async_scheduling" not in cli._engine_args(parser.parse_args([command, *extra]))
