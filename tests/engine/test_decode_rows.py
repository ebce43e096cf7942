"""The engine's decode steps (``InputBatch.build_decode``: per-slot rows, vectorized) equal
``build_step``'s row-by-row steps through a real run: n > 1 samples, penalties, logprobs,
seeds, stop tokens, aborts and preemption in a small pool (tiny random model, CPU)."""

from __future__ import annotations

import numpy as np

from jaxinfer.batch import build_step
from jaxinfer.llm import LLM
from jaxinfer.sampling_params import SamplingParams
from tests.conftest import tiny_loaded
from tests.core.test_input_batch import _assert_same


def test_every_decode_step_equals_build_step():
    # The synchronous engine: every decode step's rows come from host tokens, which
    # build_step also takes (async scheduling's device-fed steps: test_async_scheduling.py).
    llm = LLM(tiny_loaded("llama"), max_model_len=64, block_size=4, max_num_seqs=8,
              max_num_batched_tokens=64, num_kv_pages=16,  # small pool: preempts
              async_scheduling=False)
    eng, ec = llm.engine, llm.engine.config
    fast_path, steps = eng._rows.build_decode, []

    def checked(chunks, **kw):
        fast = fast_path(chunks, **kw)
        assert kw.pop("token_on_device") is False  # a synchronous engine feeds host tokens
        ref = build_step(chunks, is_prefill=False, page_size=ec.block_size,
                         token_buckets=ec.decode_buckets, slots=eng._slots.mapping, **kw)
        assert fast is not None
        _assert_same(fast, ref)
        steps.append(len(chunks))
        return fast

    eng._rows.build_decode = checked  # type: ignore[method-assign]
    rng = np.random.default_rng(0)
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, n=3),
              SamplingParams(temperature=1.0, top_k=20, max_tokens=10, seed=5, n=2,
                             repetition_penalty=1.3, frequency_penalty=0.4, logprobs=2),
              SamplingParams(temperature=0.8, top_p=0.9, max_tokens=14, ignore_eos=True),
              SamplingParams(temperature=1.0, max_tokens=12, stop_token_ids=[3, 5, 7]),
              SamplingParams(temperature=0.0, max_tokens=9, presence_penalty=1.0, min_p=0.1)]
    ids = [eng.add_request(rng.integers(2, 96, int(rng.integers(1, 15))).tolist(), sp)
           for sp in params]
    preempted, plan = [], eng.scheduler.schedule

    def counting():
        out = plan()
        preempted.extend(out.preempted)
        return out

    eng.scheduler.schedule = counting  # type: ignore[method-assign]
    for i in range(200):
        if not eng.has_unfinished_requests():
            break
        eng.step()
        if i == 6:
            eng.abort_request(ids[2])
        if i == 8:
            eng.add_request(rng.integers(2, 96, 9).tolist(),
                            SamplingParams(temperature=1.0, max_tokens=8, n=2, seed=1))
    assert not eng.has_unfinished_requests() and not eng._slots.mapping
    assert len(steps) > 10 and max(steps) > 4 and preempted
