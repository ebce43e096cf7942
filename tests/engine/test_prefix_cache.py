"""Prefix caching, alternation and queue limits through the engine (tiny random models, CPU).

Greedy outputs must not change when K/V pages are reused from the prefix cache (shared
system prompt + different suffixes, identical prompts, prompts of an exact multiple of the
page size, a follow-up turn that reuses pages written by decode steps, preemption), and the
hits must be real: the engine computes exactly the cached tokens fewer. With an FP8 KV cache
too (the engine against itself: a reused page holds the same quantized values a recompute
would write).
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxinfer.llm import LLM
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.scheduler import QueueFullError
from tests.conftest import tiny_loaded

PS = 4  # page size
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


class Counted:
    """An LLM whose executed steps are counted (tokens computed, preemptions)."""

    def __init__(self, family: str, **kw) -> None:
        args = {"max_model_len": 64, "block_size": PS, "max_num_seqs": 8,
                "max_num_batched_tokens": 32}
        args.update(kw)
        self.llm = LLM(tiny_loaded(family), **args)
        self.computed = self.preempted = 0
        engine = self.llm.engine
        collect = engine._collect

        # Every executed step's plan passes through _collect, whether the scheduler planned it
        # or async scheduling pipelined it (engine_async.plan_next_decode).
        def counting(out, res):
            self.computed += out.num_batched_tokens
            self.preempted += len(out.preempted)
            return collect(out, res)

        engine._collect = counting  # type: ignore[method-assign]

    def run(self, prompts: list[list[int]], sp: SamplingParams = GREEDY):
        outs = self.llm.generate(prompts, sp)
        return ([o.outputs[0].token_ids for o in outs],
                [int(o.metrics["num_cached_tokens"]) for o in outs])


def _workload(seed: int = 0) -> tuple[list[int], list[list[int]]]:
    rng = np.random.default_rng(seed)
    system = rng.integers(2, 96, size=13).tolist()  # 3 full pages + 1 token
    prompts = [system + rng.integers(2, 96, size=n).tolist() for n in (1, 3, 6)]
    prompts.append(list(prompts[1]))  # identical to another prompt
    prompts.append(system[:12])  # exactly 3 pages: only 2 may come from the cache
    prompts.append(system + rng.integers(2, 96, size=3).tolist())  # exactly 4 pages
    return system, prompts


@pytest.mark.parametrize("tiny_family, kv", [("llama", "auto"), ("gemma3", "auto"),
                                             ("llama", "fp8")])
def test_prefix_reuse_keeps_greedy_outputs_and_skips_cached_tokens(tiny_family, kv):
    system, prompts = _workload()
    off = Counted(tiny_family, enable_prefix_caching=False, kv_cache_dtype=kv)
    ref, cached = off.run([system + [5]] + prompts)
    assert cached == [0] * 7

    on = Counted(tiny_family, kv_cache_dtype=kv)
    first, cached = on.run([system + [5]])  # fills the cache with the system prompt's pages
    assert first == ref[:1] and cached == [0]
    out, cached = on.run(prompts)
    assert out == ref[1:], "prefix reuse changed greedy outputs"
    # Shared system prompt: 3 pages; exact 12-token prompt: 2 pages (its last token is
    # computed); the 16-token prompt: 3 pages of the system prompt.
    assert cached == [12, 12, 12, 12, 8, 12]
    assert on.computed == off.computed - sum(cached), "hits did not skip computation"
    bm = on.llm.engine.scheduler.block_manager
    assert bm.prefix_hit_tokens == sum(cached) and bm.num_used_pages == 0


def test_follow_up_turn_reuses_decoded_pages():
    rng = np.random.default_rng(1)
    turn1 = rng.integers(2, 96, size=9).tolist()
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    on = Counted("llama")
    out1, _ = on.run([turn1], sp)
    turn2 = turn1 + out1[0] + rng.integers(2, 96, size=3).tolist()  # 20 tokens
    out2, cached = on.run([turn2], sp)
    # 9 prompt + 7 fed outputs = 16 computed tokens = 4 full pages, 2 of them from decode.
    assert cached == [16]
    ref, _ = Counted("llama", enable_prefix_caching=False).run([turn2], sp)
    assert out2 == ref


@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_preemption_with_prefix_caching_keeps_outputs(kv):
    system, prompts = _workload(2)
    prompts = prompts + [system + [7, 8, 9, 10, 11]] * 2
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    ref, _ = Counted("llama", enable_prefix_caching=False, kv_cache_dtype=kv).run(prompts, sp)
    small = Counted("llama", num_kv_pages=13, kv_cache_dtype=kv)  # 12 usable pages: preempts
    out, _ = small.run(prompts, sp)
    assert small.preempted > 0 and out == ref
    bm = small.llm.engine.scheduler.block_manager
    assert bm.prefix_hit_tokens > 0 and bm.num_used_pages == 0


def test_alternation_off_gives_same_outputs():
    _, prompts = _workload(3)
    a, _ = Counted("llama", max_consecutive_prefills=None).run(prompts)
    b, _ = Counted("llama", max_consecutive_prefills=2, max_num_batched_tokens=16).run(prompts)
    assert a == b


def test_max_queue_len_rejects_new_requests():
    """max_queue_len bounds the requests waiting for one of max_num_seqs' places: those the
    free places take at the next step are not queued (a helper sent 6 requests at once to a
    server with 2 places and max_queue_len 1: 2 were taken, not 3)."""
    eng = LLM(tiny_loaded("llama"), max_model_len=64, block_size=PS, max_num_seqs=2,
              max_num_batched_tokens=32, max_queue_len=1).engine
    eng.add_request([3, 4, 5], GREEDY)
    eng.add_request([3, 4, 6], GREEDY)
    eng.add_request([3, 4, 7], GREEDY)  # the two places are taken: this one is queued
    with pytest.raises(QueueFullError, match="1 requests waiting for a place, max_queue_len "
                                             "is 1"):
        eng.add_request([3, 4, 8], GREEDY)
    eng.step()  # two admitted, the third still waits for a place
    with pytest.raises(QueueFullError):
        eng.add_request([3, 4, 8], GREEDY)
    done: dict[int, list[int]] = {}
    rid = None
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o.outputs[0].token_ids
        if rid is None and eng.scheduler.num_waiting == 0:  # the queue has room again
            rid = eng.add_request([3, 4, 8], GREEDY)
    assert rid is not None and sorted(done) == [0, 1, 2, rid]
    assert all(len(t) == GREEDY.max_tokens for t in done.values())
