"""Multi-step decode (EngineConfig.num_scheduler_steps): outputs equal the one-step engine's,
request by request, windows really run, and the plan refuses what it must."""

from __future__ import annotations

import dataclasses
import sys

import numpy as np
import pytest

from jaxinfer.config import ConfigError, EngineConfig
from jaxinfer.llm import LLM, iter_stream
from jaxinfer.multi_step import plan_multi_step
from jaxinfer.runner_multi import BACKGROUND_SWITCH_INTERVAL_S
from jaxinfer.sampling_params import SamplingParams
from tests.conftest import tiny_loaded
from tests.core.test_scheduler import make, seq
from tests.engine.test_async_scheduling import ENGINE, _workload


def _longer(params: list[SamplingParams]) -> list[SamplingParams]:
    """The async workload's requests with 3x the tokens, so windows of 4 fit inside them."""
    return [dataclasses.replace(p, max_tokens=3 * p.max_tokens) for p in params]


def _assert_same(got, want) -> None:
    """Same requests, samples, tokens and finish reasons; logprobs equal to float32 rounding
    (a window changes which rows share a step, so the batch bucket a logprobs row runs in)."""
    assert [o.request_id for o in got] == [o.request_id for o in want]
    for g, w in zip(got, want):
        assert [(c.index, c.token_ids, c.finish_reason, c.stop_reason) for c in g.outputs] == [
            (c.index, c.token_ids, c.finish_reason, c.stop_reason) for c in w.outputs]
        for gc, wc in zip(g.outputs, w.outputs):
            assert (gc.logprobs is None) == (wc.logprobs is None)
            for a, b in zip(gc.logprobs or [], wc.logprobs or []):
                assert list(a) == list(b)
                np.testing.assert_allclose(list(a.values()), list(b.values()), rtol=1e-5)


@pytest.mark.parametrize("seed, pages, k", [(0, None, 4), (1, 14, 4), (2, None, 3),
                                            (4, 16, 2)])
def test_multi_step_outputs_equal_one_step(seed, pages, k):
    """Random workloads (greedy and seeded sampling, EOS and stop ids mid-window, n > 1,
    logprobs rows, penalties, top-k / top-p, shared prefixes; a tiny pool: preemption) give
    the one-step engine's tokens and finish reasons, some windows ran, and every page
    allocated ahead was freed."""
    loaded = tiny_loaded("llama")
    prompts, params = _workload(seed)
    params = _longer(params)
    extra = {} if pages is None else {"num_kv_pages": pages}
    one = LLM(loaded, **{**ENGINE, **extra}, async_scheduling=False).generate(prompts, params)
    llm = LLM(loaded, **{**ENGINE, **extra}, num_scheduler_steps=k)
    _assert_same(llm.generate(prompts, params), one)
    assert llm.engine.num_multi_steps > 0
    assert llm.engine.scheduler.block_manager.num_used_pages == 0


def test_multi_step_streams_every_token_once():
    """Delta outputs of a window carry its k tokens; a stream's deltas add up to the
    one-step engine's tokens, and a request ending mid-window ends with the right reason."""
    loaded = tiny_loaded("llama")
    params = [SamplingParams(max_tokens=10, ignore_eos=True, output_kind="delta", seed=3),
              SamplingParams(max_tokens=7, temperature=0.8, seed=5, ignore_eos=True,
                             output_kind="delta")]
    prompts = [[5, 6, 7], [9, 10, 11, 12]]
    want = LLM(loaded, **ENGINE).generate(prompts, [dataclasses.replace(
        p, output_kind="cumulative") for p in params])
    llm = LLM(loaded, **ENGINE, num_scheduler_steps=4)
    eng = llm.engine
    rids = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
    got: dict[int, list[int]] = {r: [] for r in rids}
    sizes, reasons = [], {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            got[o.request_id] += o.outputs[0].token_ids
            sizes.append(len(o.outputs[0].token_ids))
            if o.finished:
                reasons[o.request_id] = o.outputs[0].finish_reason
    assert [got[r] for r in rids] == [w.outputs[0].token_ids for w in want]
    assert reasons == {r: "length" for r in rids}
    assert max(sizes) == 4 and eng.num_multi_steps > 0
    rid = eng.add_request([5, 6, 7], params[0])  # iter_stream over windows
    assert sum((o.outputs[0].token_ids for o in iter_stream(eng, rid)), []) == got[rids[0]]


def test_multi_step_plan_refuses_what_one_step_must_run():
    """plan_multi_step: None (nothing allocated) for a prefill, a logprobs row, a row whose
    window would pass max_model_len, a waiting request that could be admitted, too few
    never-cached free pages; otherwise k plans over the same rows, pages for k tokens."""
    def decoding(**kw):
        s = make(page_size=4, **kw)
        for i in range(2):
            s.add(seq(i, 6, max_tokens=10))
        out = s.schedule()
        s.postprocess(out, [7] * len(out.chunks))  # both prefilled, one token each
        return s

    s = decoding()
    assert plan_multi_step(s, s.schedule(), 1, 256) is None  # k = 1: off
    s = decoding()
    out = s.schedule()
    steps = plan_multi_step(s, out, 4, 256)
    assert steps is not None and steps[0] is out
    assert [[(c.seq.seq_id, c.start, c.samples) for c in o.chunks] for o in steps] == [
        [(0, 6 + j, True), (1, 6 + j, True)] for j in range(4)]
    assert [len(q.block_table) for q in s.running] == [3, 3]  # tokens 0..9 on 4-token pages
    for j, o in enumerate(steps):
        new, _ = s.postprocess(o, [11 + j, 21 + j])
        assert [t for _, t in new] == [11 + j, 21 + j]
    assert [q.output_token_ids for q in s.running] == [[7, 11, 12, 13, 14], [7, 21, 22, 23, 24]]

    s = decoding()
    out = s.schedule()
    assert plan_multi_step(s, out, 8, 13) is None  # positions 6..13: 13 is past the limit
    assert plan_multi_step(s, out, 8, 14) is not None
    s = decoding()
    s.running[1].sampling_params = SamplingParams(max_tokens=10, logprobs=1)
    out = s.schedule()
    pages = [len(q.block_table) for q in s.running]
    assert plan_multi_step(s, out, 4, 256) is None
    assert [len(q.block_table) for q in s.running] == pages  # nothing allocated
    s = decoding()
    s.add(seq(9, 3))  # fits: the one-step engine would admit it next step
    assert plan_multi_step(s, s.schedule(), 4, 256) is None
    s = decoding(num_pages=7)  # 6 usable pages, 4 held: 2 free, a window of 6 needs 2
    assert plan_multi_step(s, s.schedule(), 6, 256) is not None
    s = decoding(num_pages=7)
    assert plan_multi_step(s, s.schedule(), 7, 256) is None  # needs 4
    s = make(page_size=4)
    s.add(seq(0, 6))
    assert plan_multi_step(s, s.schedule(), 4, 256) is None  # a prefill step


def test_next_window_plan_pipelines_only_what_the_one_step_engine_would_run():
    """plan_next_decode(window=k) from a window in flight: the next k plans over the rows that
    do not end by length inside it, feeding from the token k past the window's first, pages
    for 2k tokens; None (nothing allocated) when a request waits or a kept row's next window
    would pass max_model_len."""
    from jaxinfer.engine_async import plan_next_decode

    def window(max_tokens=(30, 30), **kw):
        s = make(page_size=4, **kw)
        for i, m in enumerate(max_tokens):
            s.add(seq(i, 6, max_tokens=m))
        out = s.schedule()
        s.postprocess(out, [7] * len(out.chunks))  # both prefilled, one token each
        out = s.schedule()
        return s, out, plan_multi_step(s, out, 4, 256)

    s, out, steps = window()
    nxt = plan_next_decode(s, out, 2, (1, 2, 4), 256, window=4)
    assert [[(c.seq.seq_id, c.start, c.samples) for c in o.chunks] for o in nxt.steps] == [
        [(0, 10 + j, True), (1, 10 + j, True)] for j in range(4)]
    assert nxt.out is nxt.steps[0] and nxt.rows.tolist() == [0, 1]
    assert [len(q.block_table) for q in s.running] == [4, 4]  # tokens 0..13 on 4-token pages
    for o in steps + nxt.steps:  # recorded in order, they extend both rows by 8 tokens
        s.postprocess(o, [11, 21])
    assert [q.num_output_tokens for q in s.running] == [9, 9]

    s, out, _ = window(max_tokens=(30, 5))  # row 1 ends by length inside the window
    nxt = plan_next_decode(s, out, 2, (1, 2, 4), 256, window=4)
    assert nxt is None  # 1 row left: batch bucket 1, the gather program is keyed by 2
    s, out, _ = window(max_tokens=(30, 5))
    nxt = plan_next_decode(s, out, 2, (2, 4), 256, window=4)
    assert [[c.seq.seq_id for c in o.chunks] for o in nxt.steps] == [[0]] * 4
    assert nxt.rows.tolist() == [0, 0]

    s, out, _ = window()
    pages = [len(q.block_table) for q in s.running]
    assert plan_next_decode(s, out, 2, (1, 2, 4), 13, window=4) is None  # positions 10..13
    assert plan_next_decode(s, out, 2, (1, 2, 4), 14, window=4) is not None
    s, out, _ = window()
    s.add(seq(9, 3))  # waits: no window is planned over it
    assert plan_next_decode(s, out, 2, (1, 2, 4), 256, window=4) is None
    assert [len(q.block_table) for q in s.running] == pages  # nothing allocated


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_windows_pipeline_with_async_scheduling_only(async_scheduling):
    """With async scheduling, windows are dispatched before the one in flight is read (EOS
    and a stop id inside windows, seeded sampling, penalties); tokens and finish reasons equal
    the one-step engine's and every page is freed. Without it, none pipelines."""
    loaded = tiny_loaded("llama")
    rng = np.random.default_rng(7)
    prompts = [rng.integers(2, 90, int(rng.integers(3, 9))).tolist() for _ in range(4)]
    params = [SamplingParams(max_tokens=20, ignore_eos=True),
              SamplingParams(max_tokens=23, temperature=0.8, seed=2, ignore_eos=True),
              SamplingParams(max_tokens=17, temperature=1.0, top_k=5, seed=4,
                             repetition_penalty=1.2, ignore_eos=True),
              SamplingParams(max_tokens=25, temperature=0.9, seed=6)]  # EOS at token 4
    probe = LLM(loaded, **ENGINE, async_scheduling=False)
    # request 1 stops at its 10th token's id (mid-window: the third window)
    stop = probe.generate(prompts[1], params[1])[0].outputs[0].token_ids[9]
    params[1] = dataclasses.replace(params[1], stop_token_ids=[stop])
    one = LLM(loaded, **ENGINE, async_scheduling=False).generate(prompts, params)
    assert [(len(o.outputs[0].token_ids), o.outputs[0].finish_reason) for o in one][1:] == [
        (probe.generate(prompts[1], params[1])[0].outputs[0].token_ids.index(stop) + 1,
         "stop"), (17, "length"), (4, "stop")]
    llm = LLM(loaded, **ENGINE, num_scheduler_steps=4, async_scheduling=async_scheduling)
    _assert_same(llm.generate(prompts, params), one)
    eng = llm.engine
    assert eng.num_multi_steps > 0 and eng.num_pipelined_steps == 0
    assert (eng.num_pipelined_windows > 0) == async_scheduling
    assert eng.scheduler.block_manager.num_used_pages == 0


@pytest.mark.parametrize("bad", [0, -2, 1.5, True])
def test_num_scheduler_steps_must_be_a_positive_integer(bad):
    with pytest.raises(ConfigError, match=f"num_scheduler_steps must be a positive integer, "
                                          f"got {bad!r}"):
        EngineConfig(num_scheduler_steps=bad)


def test_serving_warm_up_builds_the_common_multi_step_programs():
    """A server's warm-up compiles the greedy and temperature k-step programs of every batch
    bucket, so such windows compile nothing while serving."""
    from jaxinfer.runner_multi import MULTI_STEP_WARM_VARIANTS
    from jaxinfer.serving.server import warm_up

    llm = LLM(tiny_loaded("llama"), **ENGINE, num_scheduler_steps=4)
    eng = llm.engine
    warm_up(eng)
    built = set(eng.multi_step_programs._programs)
    assert {(b.num_seqs, v, k) for b, v, k in built} == {
        (b, v, 4) for b in ENGINE["decode_buckets"] for v in MULTI_STEP_WARM_VARIANTS}
    llm.generate([[5, 6, 7], [8, 9]], [
        SamplingParams(max_tokens=12, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.9, seed=1, ignore_eos=True)])
    assert eng.num_multi_steps > 0 and set(eng.multi_step_programs._programs) == built


def test_multi_step_bucket_names_the_program_and_splits_back():
    """The compile-cache key of a k-step program: the decode bucket's shape, kind
    "<variant>.k<k>", and back; anything else is refused with what was wrong."""
    from jaxinfer.batch import Bucket
    from jaxinfer.runner_multi import multi_step_bucket, split_multi_step_bucket
    from jaxinfer.sampling import SAMPLER_VARIANTS

    dec = Bucket("decode", 16, 16, 8)
    for variant in SAMPLER_VARIANTS:
        b = multi_step_bucket(dec, variant, 8)
        assert b.kind == f"{variant}.k8" and b.num_seqs == 16 and b.max_pages == 8
        assert split_multi_step_bucket(b) == (dec, variant, 8)
    for bucket, variant, k in ((Bucket("prefill", 16, 2, 4), "greedy", 4),
                               (dec, "no-such-sampler", 4), (dec, "greedy", 1)):
        with pytest.raises(ValueError, match="no multi-step program for"):
            multi_step_bucket(bucket, variant, k)
    for kind in ("greedy", "greedy.k1", "nosuch.k4", "greedy.kx"):
        with pytest.raises(ValueError, match="is not a multi-step program's bucket"):
            split_multi_step_bucket(Bucket(kind, 16, 16, 8))


@pytest.mark.parametrize("k", [1, 4])
def test_steps_pipeline_after_the_prefix_cache_holds_every_free_page(k):
    """A server's earlier traffic leaves every free page cached (evictable); with nothing
    waiting a pipelined step (k = 1) or window (k = 4) may still evict them, as the
    synchronous scheduler's next steps would: the same batch pipelines as on a fresh engine,
    with the synchronous one-step engine's tokens, and every page comes back. (Before
    engine_async.pages_ahead, plans took never-cached pages only and nothing pipelined.)"""
    loaded = tiny_loaded("llama")
    rng = np.random.default_rng(0)
    kw = {**ENGINE, "num_kv_pages": 48}
    sp = SamplingParams(max_tokens=24, temperature=0.9, seed=3, ignore_eos=True)
    batch = [rng.integers(2, 96, 12).tolist() for _ in range(2)]
    want = LLM(loaded, **kw, async_scheduling=False).generate(batch, sp)
    llm = LLM(loaded, **kw, num_scheduler_steps=k)
    eng, bm = llm.engine, llm.engine.scheduler.block_manager
    for _ in range(6):  # distinct earlier traffic: the prefix cache takes the freed pages
        llm.generate([rng.integers(2, 96, 12).tolist() for _ in range(2)], sp)
    # never-cached free pages: 2 left of 47 (fewer than the 9 pages a request of the batch
    # fills): the rest hold cached K/V
    assert bm.num_free_pages - bm.num_evictable_pages < 4
    before = eng.num_pipelined_steps + eng.num_pipelined_windows
    got = llm.generate(batch, sp)
    assert [(c.token_ids, c.finish_reason) for o in got for c in o.outputs] == [
        (c.token_ids, c.finish_reason) for o in want for c in o.outputs]
    assert eng.num_pipelined_steps + eng.num_pipelined_windows - before >= 3
    assert bm.num_used_pages == 0


@pytest.mark.parametrize("k", [1, 4])
def test_no_step_stays_in_flight_once_every_request_is_done(k):
    """A step (k = 1) or window (k = 4) dispatched ahead whose rows then all finish or are
    aborted is forgotten at once: the engine holds nothing in flight, and a request added
    next gets its first token from the very next step() (not one call later)."""
    loaded = tiny_loaded("llama")
    llm = LLM(loaded, **ENGINE, num_scheduler_steps=k)
    eng = llm.engine
    sp = SamplingParams(max_tokens=40, ignore_eos=True)
    rid = eng.add_request([5, 6, 7, 8, 9], sp)
    for _ in range(6):
        eng.step()
    assert eng._pending is not None  # a step or window dispatched ahead
    assert eng.abort_request(rid)
    assert eng._pending is None and not eng.has_unfinished_requests()
    rid = eng.add_request([5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))
    outs = eng.step()
    assert [o.request_id for o in outs] == [rid] and len(outs[0].outputs[0].token_ids) == 1
    # finishing by length inside a window in flight: nothing left in flight either
    while eng.has_unfinished_requests():
        eng.step()
    assert eng._pending is None
    assert eng.scheduler.block_manager.num_used_pages == 0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_an_unbuilt_variant_runs_one_step_while_its_program_builds(async_scheduling):
    """After the warm-up, a top-p batch's first windows run as one step (their one-step
    programs are built) while the top-p k-step program builds on a background thread; once
    it is built the windows use it; tokens equal the one-step engine's throughout. A failed
    background build leaves its windows one-step, the outputs still right."""
    from jaxinfer.warmup import warm_up

    def tokens(outs):  # request ids differ from run to run of one LLM
        return [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in outs]

    loaded = tiny_loaded("llama")
    prompts = [[5, 6, 7], [8, 9], [3, 1, 4, 1]]
    params = [SamplingParams(max_tokens=24, temperature=0.8, top_p=0.7, seed=i,
                             ignore_eos=True) for i in range(3)]
    want = LLM(loaded, **ENGINE, async_scheduling=False).generate(prompts, params)
    llm = LLM(loaded, **ENGINE, num_scheduler_steps=4, async_scheduling=async_scheduling)
    eng, progs = llm.engine, llm.engine.multi_step_programs
    warm_up(eng)
    warm = set(progs._programs)
    assert all(v != "top_p" for _, v, _ in warm)
    assert tokens(llm.generate(prompts, params)) == tokens(want)
    assert eng.num_one_step_windows > 0
    progs.wait_background()
    assert progs._background is not None and not progs.failed
    built = set(progs._programs) - warm
    assert built and {v for _, v, _ in built} == {"top_p"}
    n_one, n_multi = eng.num_one_step_windows, eng.num_multi_steps
    assert tokens(llm.generate(prompts, params)) == tokens(want)
    assert eng.num_one_step_windows == n_one and eng.num_multi_steps > n_multi

    intervals, before = [], sys.getswitchinterval()

    def fail(*args):
        intervals.append(sys.getswitchinterval())
        raise RuntimeError("out of memory (test)")

    progs.lower = fail  # the next new program (logit_bias: another variant) cannot build
    params = [dataclasses.replace(p, logit_bias={4: 1.5}) for p in params]
    want = LLM(loaded, **ENGINE, async_scheduling=False).generate(prompts, params)
    assert tokens(llm.generate(prompts, params)) == tokens(want)
    progs.wait_background()
    assert [v for _, v, _ in progs.failed] == ["top_k_top_p_full_bias"]
    # the build ran at the short switch interval, restored after it (failed or not)
    assert intervals == [BACKGROUND_SWITCH_INTERVAL_S] < [before]
    assert sys.getswitchinterval() == before
    n_one = eng.num_one_step_windows
    assert tokens(llm.generate(prompts, params)) == tokens(want)
    assert eng.num_one_step_windows > n_one  # not tried again: one step


def test_without_built_one_step_programs_a_window_builds_its_program_at_once():
    """An offline run without warm-up builds a new variant's k-step program at its first
    window (the one-step fallback would compile too): no window runs as one step."""
    llm = LLM(tiny_loaded("llama"), **ENGINE, num_scheduler_steps=4)
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=16, top_p=0.7, seed=0,
                                             ignore_eos=True))
    eng = llm.engine
    assert eng.num_multi_steps > 0 and eng.num_one_step_windows == 0
    assert eng.multi_step_programs._background is None
