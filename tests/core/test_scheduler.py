"""Scheduler: policy, limits, errors, and long random simulations against a fake model.

The fake model keeps a real "KV cache" (one token id per slot, written through the block
tables) and samples a token that depends only on (request, position). So every request's
output is known in advance whatever the batching, chunking or preemption, and a sampling step
also checks that the cache, read back through the block table, holds exactly the sequence's
tokens (pages clobbered by another sequence would show here).
"""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxinfer.config import ConfigError
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.scheduler import (
    DuplicateRequestError,
    QueueFullError,
    RequestTooLongError,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
    SequenceStateError,
    TooManySamplesError,
)
from jaxinfer.sequence import Sequence, SequenceStatus

EOS = 0
VOCAB = 50  # EOS is sampled ~2 % of the time


def fake_token(seq_id: int, pos: int, index: int = 0) -> int:
    """The token the fake model samples after seeing tokens [0, pos) of sample ``index`` of
    request seq_id."""
    x = (seq_id * 0x9E3779B1 + pos * 0x85EBCA77 + index * 0x27D4EB2F + 12345) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x2C1B3C6D) & 0xFFFFFFFF
    x ^= x >> 12
    return x % VOCAB


def expected_output(seq_id: int, prompt_len: int, sp: SamplingParams, eos: tuple[int, ...],
                    max_model_len: int, index: int = 0) -> tuple[list[int], str]:
    """Sample ``index``'s output under vLLM's stop rules, computed without the scheduler."""
    out: list[int] = []
    while True:
        tok = fake_token(seq_id, prompt_len + len(out), index)
        out.append(tok)
        if len(out) >= sp.min_tokens and (
                (tok in eos and not sp.ignore_eos) or tok in sp.stop_token_ids):
            return out, "stop"
        if len(out) >= sp.max_tokens or prompt_len + len(out) >= max_model_len:
            return out, "length"


def check_pages(sched: Scheduler) -> None:
    bm = sched.block_manager
    owned = Counter(p for s in sched.running for p in s.block_table)
    free = bm.free_page_ids()
    assert len(free) == len(set(free)) == bm.num_free_pages
    # Held and free pages partition 1..P-1: no leak, no page both, null page never out.
    assert sorted(list(owned) + free) == list(range(1, bm.num_pages)), "page accounting broken"
    rc = bm.ref_count
    for p, n in owned.items():  # reference count = block tables holding the page
        assert rc[p] == n, f"page {p}: ref count {rc[p]}, held by {n} sequences"
    assert rc[0] == 1 and sum(rc) == 1 + sum(owned.values())  # free pages at 0
    for s in sched.running:
        assert s.status is SequenceStatus.RUNNING
        assert len(set(s.block_table)) == len(s.block_table), f"page twice in {s!r}"
        # Shared pages are full and computed: nobody writes them again.
        for p in s.block_table[s.num_computed_tokens // bm.page_size:]:
            assert rc[p] == 1, f"{s!r} will write page {p}, which is shared"
    for s in sched.waiting:
        assert s.status is SequenceStatus.WAITING and not s.block_table
        assert s.num_computed_tokens == 0


@dataclass
class SimStats:
    steps: int = 0
    prefill_steps: int = 0
    preemptions: int = 0
    chunked: int = 0  # prefill chunks that did not end at the sequence's last token
    allocated_slots: int = 0
    used_slots: int = 0
    finished: dict[int, Sequence] = field(default_factory=dict)

    @property
    def kv_waste(self) -> float:
        return 1.0 - self.used_slots / max(1, self.allocated_slots)


class Sim:
    """Drives a Scheduler with a fake model and checks every invariant after every step."""

    def __init__(self, cfg: SchedulerConfig, full_checks: bool = True) -> None:
        self.cfg, self.full_checks = cfg, full_checks
        self.sched = Scheduler(cfg)
        self.kv = np.full(cfg.num_pages * cfg.page_size, -1, np.int64)
        self.stats = SimStats()
        self.expected: dict[tuple[int, int], tuple[list[int], str]] = {}  # by Sequence.key
        self.add_order: list[int] = []
        self.admitted: list[int] = []  # first admission order
        self.aborted: set[int] = set()
        self.forks = 0  # samples forked
        self.copies = 0  # copy-on-write page copies run

    def add(self, seq: Sequence) -> None:
        self.sched.add(seq)
        for i in range(seq.sampling_params.n):
            self.expected[(seq.seq_id, i)] = expected_output(
                seq.seq_id, seq.num_prompt_tokens, seq.sampling_params, self.cfg.eos_token_ids,
                self.cfg.max_model_len, i)
        self.add_order.append(seq.seq_id)

    def abort(self, seq_id: int) -> None:
        bm = self.sched.block_manager
        free_before, seq = bm.num_free_pages, self.sched.get(seq_id)
        live = [s for s in seq.group.samples if not s.is_finished] if seq is not None else []
        # Pages only this request's samples hold (shared prefix pages stay with the others).
        mine = Counter(p for s in live for p in s.block_table)
        held = sum(bm.ref_count[p] == n for p, n in mine.items())
        got = self.sched.abort(seq_id)
        assert got is (seq.group.samples[0] if seq is not None else None)
        if seq is not None:
            for s in live:
                assert s.finish_reason == "abort" and s.is_finished and not s.block_table
                self._finish(s)
            assert bm.num_free_pages == free_before + held  # freed at once
            assert self.sched.get(seq_id) is None
            self.aborted.add(seq_id)

    def _finish(self, seq: Sequence) -> None:
        assert seq.key not in self.stats.finished, f"{seq!r} finished twice"
        self.stats.finished[seq.key] = seq

    def check_plan(self, out: SchedulerOutput, had_work: bool,
                   was_waiting: set[int]) -> None:
        cfg, ps = self.cfg, self.cfg.page_size
        assert out.is_empty == (not had_work), "no progress although work is pending"
        assert len(self.sched.running) <= cfg.max_num_seqs
        assert out.num_batched_tokens <= cfg.max_num_batched_tokens
        seqs = [c.seq for c in out.chunks]
        assert len(set(map(id, seqs))) == len(seqs), "a sequence scheduled twice"
        for p in out.preempted:
            assert p.status is SequenceStatus.WAITING and p not in seqs
        scheduled = {id(c.seq): c.num_tokens for c in out.chunks}
        for c in out.chunks:
            s = c.seq
            assert s.status is SequenceStatus.RUNNING
            assert c.start == s.num_computed_tokens and c.num_tokens >= 1
            assert c.start + c.num_tokens <= s.num_tokens
            assert c.samples == (c.start + c.num_tokens == s.num_tokens)
            assert c.token_ids == s.all_token_ids[c.start:c.start + c.num_tokens]
            if id(s) in was_waiting:  # admitted now: starts after its cached prefix
                assert c.start == s.num_cached_tokens and s.num_cached_tokens % ps == 0
                assert s.num_cached_tokens <= s.num_tokens - 1
                assert cfg.enable_prefix_caching or s.num_cached_tokens == 0
            if out.is_prefill and not cfg.enable_chunked_prefill:
                assert c.samples or (s.fork_pending and c.start + c.num_tokens == s.num_tokens - 1)
                assert c.start == 0 or c.start == s.num_cached_tokens
            if out.is_prefill and s.fork_pending:  # sample 0 stops before its last token
                assert c.start + c.num_tokens <= s.num_tokens - 1 and not c.samples
            if not out.is_prefill:
                assert c.num_tokens == 1 and c.start == s.num_tokens - 1
        if out.is_prefill:
            assert len(out.chunks) <= cfg.max_prefill_seqs
        unused, pages = 0, set()
        for s in self.sched.running:  # pages allocated exactly for the computed + scheduled
            tokens = s.num_computed_tokens + scheduled.get(id(s), 0)
            assert len(s.block_table) == math.ceil(tokens / ps), s
            unused += len(s.block_table) * ps - tokens  # only in its last page, never shared
            pages.update(s.block_table)
        assert unused <= (ps - 1) * len(self.sched.running)
        self.stats.allocated_slots += len(pages) * ps  # physical: shared pages count once
        self.stats.used_slots += len(pages) * ps - unused

    def last_sample(self, s: Sequence) -> bool:
        return s.num_output_tokens + 1 == len(self.expected[s.key][0])

    def fake_model(self, out: SchedulerOutput) -> list[int]:
        ps, sampled = self.cfg.page_size, []
        for src, dst in out.page_copies:  # copy-on-write before the step, as the engine does
            assert src != dst and 0 not in (src, dst)
            self.kv[dst * ps:(dst + 1) * ps] = self.kv[src * ps:(src + 1) * ps]
            self.copies += 1
        for c in out.chunks:
            s, end = c.seq, c.start + c.num_tokens
            table = np.asarray(s.block_table)
            pos = np.arange(c.start, end)
            self.kv[table[pos // ps] * ps + pos % ps] = c.token_ids
            if c.samples and self.full_checks and (
                    out.is_prefill or end % 7 == 0 or self.last_sample(s)):
                # Read the whole sequence back through its block table (every prefill, the
                # last sample, and every 7th position: enough to catch lost or shared pages).
                pos = np.arange(end)
                cached = self.kv[table[pos // ps] * ps + pos % ps]
                assert cached.tolist() == s.all_token_ids, f"KV cache corrupted for {s!r}"
            if c.samples:
                sampled.append(fake_token(s.seq_id, end, s.sample_index))
            else:
                sampled.append(-7)  # must be ignored
        return sampled

    def step(self, rng: random.Random | None = None) -> SchedulerOutput:
        had_work = self.sched.has_unfinished
        was_waiting = {id(s) for s in self.sched.waiting}
        known = {id(s) for s in self.sched.running} | was_waiting
        out = self.sched.schedule()
        for s in [*self.sched.running, *self.sched.waiting]:
            if id(s) in known:
                continue
            # Forked in this plan (perhaps preempted again at once): a new sample, which
            # shares sample 0's computed prompt pages.
            self.forks += 1
            assert s.sample_index > 0 and not s.output_token_ids
            lead = s.group.samples[0]
            if s.status is SequenceStatus.RUNNING:
                n_full = s.num_computed_tokens // self.cfg.page_size
                assert s.num_computed_tokens == s.num_prompt_tokens - 1
                assert s.block_table[:n_full] == lead.block_table[:n_full]
        self.stats.steps += 1
        self.stats.prefill_steps += out.is_prefill
        self.stats.preemptions += len(out.preempted)
        self.stats.chunked += sum(not c.samples for c in out.chunks)
        self.check_plan(out, had_work, was_waiting)
        for s in self.sched.running:  # admitted now (in order), with or without a chunk
            if id(s) in was_waiting and s.num_preemptions == 0 and s.seq_id not in self.admitted:
                self.admitted.append(s.seq_id)
        if self.full_checks:
            check_pages(self.sched)
        sampled = self.fake_model(out)
        if rng is not None and out.chunks and rng.random() < 0.01:  # abort mid-step
            self.abort(rng.choice(out.chunks).seq.seq_id)
        before = {id(c.seq): c.seq.num_output_tokens for c in out.chunks}
        new_tokens, finished = self.sched.postprocess(out, sampled)
        for seq, tok in new_tokens:
            assert seq.output_token_ids[-1] == tok and before[id(seq)] + 1 == seq.num_output_tokens
        for seq in finished:
            assert seq.is_finished and not seq.block_table
            assert (self.sched.get(seq.seq_id) is None) == seq.group.is_finished
            assert seq.finish_reason in ("stop", "length")
            self._finish(seq)
        if self.full_checks:
            check_pages(self.sched)
        return out

    def check_final(self) -> None:
        assert not self.sched.has_unfinished
        assert self.sched.block_manager.num_free_pages == self.cfg.num_pages - 1
        # Every sample finished once; an aborted request may have been aborted before its fork.
        assert set(self.stats.finished) <= set(self.expected)
        assert {k for k in self.expected if k[0] not in self.aborted} <= set(self.stats.finished)
        assert {sid for sid, _ in self.stats.finished} == set(self.add_order)
        for key, seq in self.stats.finished.items():
            if key[0] in self.aborted:
                continue
            tokens, reason = self.expected[key]
            assert seq.output_token_ids == tokens, f"request {key} output differs"
            assert seq.finish_reason == reason
        order = {sid: i for i, sid in enumerate(self.add_order)}
        ranks = [order[s] for s in self.admitted]
        assert ranks == sorted(ranks), "admission is not first-come first-served"


def random_request(rng: random.Random, seq_id: int, max_prompt: int, max_out: int,
                   systems: list[list[int]] | None = None, max_n: int = 1) -> Sequence:
    """A random request; with ``systems``, most prompts start with one of those shared
    "system prompts" (some are exactly one), so prefix caching gets hits. With ``max_n`` > 1
    a third of the requests ask for 2..max_n samples."""
    prompt: list[int] = []
    if systems and rng.random() < 0.7:
        prompt = rng.choice(systems)[:max_prompt]
        if rng.random() < 0.2 and len(prompt) < max_prompt:
            prompt = prompt[:rng.randint(1, len(prompt))]  # a shorter shared prefix
    if not prompt or rng.random() < 0.8:
        room = max(1, max_prompt - len(prompt))
        prompt = (prompt + [1 + int(rng.random() * (VOCAB - 1))
                            for _ in range(rng.randint(1, room))])[:max_prompt]
    max_tokens = rng.randint(1, max_out)
    n = rng.randint(2, max_n) if max_n > 1 and rng.random() < 1 / 3 else 1
    sp = SamplingParams(max_tokens=max_tokens, min_tokens=rng.choice([0, 0, min(3, max_tokens)]),
                        ignore_eos=rng.random() < 0.2,
                        stop_token_ids=[rng.randrange(1, VOCAB)] if rng.random() < 0.1 else [],
                        n=n)
    return Sequence(seq_id, prompt, sp)


def run_random(cfg: SchedulerConfig, n_requests: int, seed: int, max_prompt: int,
               max_out: int, abort_rate: float = 0.0, shared_prefixes: bool = True,
               max_n: int = 1) -> Sim:
    rng = random.Random(seed)
    sim = Sim(cfg)
    ps = cfg.page_size  # system prompts of 4 pages exactly and of random lengths
    systems = [[rng.randrange(1, VOCAB) for _ in range(n)]
               for n in (4 * ps, rng.randint(1, max_prompt), rng.randint(1, max_prompt))]
    next_id, pending = 0, None
    while next_id < n_requests or sim.sched.has_unfinished:
        for _ in range(rng.choice([0, 0, 1, 1, 2, 4])):
            if next_id == n_requests:
                break
            pending = pending or random_request(rng, next_id, max_prompt, max_out,
                                                systems if shared_prefixes else None, max_n)
            try:
                sim.add(pending)
            except QueueFullError:
                assert sim.sched.num_waiting >= cfg.max_queue_len  # preempted ones rejoin
                break
            next_id, pending = next_id + 1, None
        if abort_rate and rng.random() < abort_rate and sim.add_order:
            sim.abort(rng.choice(sim.add_order[-50:]))
        sim.step(rng if abort_rate else None)
    sim.check_final()
    return sim


@pytest.mark.parametrize("n, caching, alternate, max_n", [
    (1000, True, 1, 1), (1000, False, None, 1), (1000, True, 3, 1), (1000, True, 1, 4),
    (1000, False, 1, 3), pytest.param(10_000, True, 1, 1, marks=pytest.mark.slow),
    pytest.param(10_000, True, 1, 4, marks=pytest.mark.slow)])
def test_simulation_random_requests(n: int, caching: bool, alternate: int | None,
                                    max_n: int) -> None:
    """Pages are checked after every step (no leak, none held twice by one sequence, reference
    counts exact, shared pages never written) and every output against its known tokens.
    With ``max_n`` > 1 a third of the requests fork 2..max_n samples: forked samples share
    sample 0's pages, copy a partial last page before they write it, and are preempted and
    recomputed on their own."""
    cfg = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=64, max_model_len=160,
                          page_size=8, num_pages=60, max_prefill_seqs=4, max_queue_len=40,
                          enable_prefix_caching=caching, max_consecutive_prefills=alternate,
                          eos_token_ids=(EOS,))
    sim = run_random(cfg, n, seed=n * max_n, max_prompt=80, max_out=60, abort_rate=0.005,
                     max_n=max_n)
    st_, bm = sim.stats, sim.sched.block_manager
    print(f"\n{n} requests (prefix caching {caching}, alternation {alternate}, n <= {max_n}): "
          f"{sim.forks} forked samples, {sim.copies} page copies, {st_.steps} "
          f"steps ({st_.prefill_steps} prefill), {st_.preemptions} preemptions, {st_.chunked} "
          f"partial chunks, {len(sim.aborted)} aborted, KV waste {st_.kv_waste:.3f}, prefix "
          f"hits {bm.prefix_hit_tokens} tokens ({100 * bm.prefix_hit_rate:.1f} %), "
          f"{bm.num_evictions} evictions")
    assert st_.preemptions > 0 and st_.chunked > 0 and sim.aborted  # the workload did stress
    if max_n > 1:
        forked = [s for s in st_.finished.values() if s.sample_index > 0]
        assert sim.forks >= len(forked) > n // 10 and sim.copies > n // 20
        assert any(s.num_preemptions for s in forked)  # samples preempted on their own
    else:
        assert sim.forks == sim.copies == 0
    if caching:
        assert bm.prefix_hit_rate > 0.1 and bm.num_evictions > 0
    else:
        assert bm.prefix_hit_tokens == 0 and bm.num_cached_pages == 0


@settings(max_examples=80, deadline=None, database=None)
@given(page_size=st.sampled_from([1, 2, 4, 16]), max_num_seqs=st.integers(1, 6),
       extra_budget=st.integers(0, 40), max_prefill_seqs=st.integers(1, 4),
       num_pages=st.integers(2, 40), chunked=st.booleans(), max_model_len=st.integers(2, 64),
       seed=st.integers(0, 2**16), max_n=st.sampled_from([1, 1, 3, 8]))
def test_simulation_random_configs(page_size: int, max_num_seqs: int, extra_budget: int,
                                   max_prefill_seqs: int, num_pages: int, chunked: bool,
                                   max_model_len: int, seed: int, max_n: int) -> None:
    budget = max_num_seqs + extra_budget
    if not chunked:
        budget = max(budget, max_model_len)
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                          max_model_len=max_model_len, page_size=page_size,
                          num_pages=num_pages, max_prefill_seqs=max_prefill_seqs,
                          enable_chunked_prefill=chunked, eos_token_ids=(EOS,))
    rng = random.Random(seed)
    sim = Sim(cfg)
    for i in range(30):
        seq = random_request(rng, i, max_prompt=max_model_len, max_out=max_model_len,
                             max_n=max_n)
        p, m, k = seq.num_prompt_tokens, seq.sampling_params.max_tokens, seq.sampling_params.n
        shared = (p - 1) // page_size if k > 1 else 0  # full prompt pages, held once
        pages = shared + k * (math.ceil((p + m - 1) / page_size) - shared)
        if p + m <= max_model_len and k > max_num_seqs:
            with pytest.raises(TooManySamplesError, match="max_num_seqs"):
                sim.sched.add(seq)
        elif p + m <= max_model_len and pages <= num_pages - 1:
            sim.add(seq)
        else:
            with pytest.raises(RequestTooLongError):
                sim.sched.add(seq)
    while sim.sched.has_unfinished:
        sim.step()
    sim.check_final()


def make(**kw) -> Scheduler:
    base = {"max_num_seqs": 4, "max_num_batched_tokens": 32, "max_model_len": 256,
            "page_size": 16, "num_pages": 64, "eos_token_ids": (EOS,)}
    base.update(kw)
    return Scheduler(SchedulerConfig(**base))


def seq(seq_id: int, n: int, max_tokens: int = 8, **sp) -> Sequence:
    return Sequence(seq_id, [1 + (seq_id + i) % (VOCAB - 1) for i in range(n)],
                    SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sp))


def step(s: Scheduler, tok: int = 5) -> tuple[SchedulerOutput, list, list]:
    out = s.schedule()
    new, fin = s.postprocess(out, [tok] * len(out.chunks))
    return out, new, fin


def test_chunked_prefill_splits_and_resumes() -> None:
    s = make()
    long = seq(0, 100)
    s.add(long)
    out, new, _ = step(s)
    assert out.is_prefill and [(c.start, c.num_tokens, c.samples) for c in out.chunks] == [
        (0, 32, False)]
    assert new == [] and long.num_computed_tokens == 32 and len(long.block_table) == 2
    s.add(seq(1, 10))  # arrives mid-prefill: the partial prefill continues first
    out, _, _ = step(s)
    assert [(c.seq.seq_id, c.start, c.num_tokens) for c in out.chunks] == [(0, 32, 32)]
    out, _, _ = step(s)
    assert [(c.seq.seq_id, c.start, c.num_tokens) for c in out.chunks] == [(0, 64, 32)]
    assert len(long.block_table) == 6
    out, new, _ = step(s)  # last 4 prompt tokens, then seq 1 fills the remaining budget
    assert [(c.seq.seq_id, c.start, c.num_tokens, c.samples) for c in out.chunks] == [
        (0, 96, 4, True), (1, 0, 10, True)]
    assert [(q.seq_id, t) for q, t in new] == [(0, 5), (1, 5)]
    assert long.num_computed_tokens == 100 and long.num_tokens == 101
    out, _, _ = step(s)
    assert not out.is_prefill and [(c.seq.seq_id, c.start) for c in out.chunks] == [
        (0, 100), (1, 10)]


def test_single_token_tail_is_decoded() -> None:
    s = make()
    a = seq(0, 33)
    s.add(a)
    out, _, _ = step(s)
    assert out.chunks[0].num_tokens == 32 and not out.chunks[0].samples
    out, new, _ = step(s)  # one token left: decode-shaped, and it samples
    assert not out.is_prefill and (out.chunks[0].start, out.chunks[0].samples) == (32, True)
    assert new == [(a, 5)]


def test_no_chunking_waits_for_budget() -> None:
    s = make(enable_chunked_prefill=False, max_num_batched_tokens=256,
             max_consecutive_prefills=None)
    s.add(seq(0, 200))
    s.add(seq(1, 100))  # 200 + 100 > 256: next step
    out, _, _ = step(s)
    assert [(c.seq.seq_id, c.num_tokens) for c in out.chunks] == [(0, 200)]
    out, _, _ = step(s)
    assert out.is_prefill and [(c.seq.seq_id, c.num_tokens) for c in out.chunks] == [(1, 100)]


@pytest.mark.parametrize("caching", [False, True])
def test_preemption_under_pressure_and_completion(caching: bool) -> None:
    # 5 usable pages of 4 tokens; two sequences of 6 prompt + 8 output tokens need 4 pages each.
    s = make(page_size=4, num_pages=6, max_model_len=20, enable_prefix_caching=caching)
    a, b = seq(0, 6, max_tokens=8), seq(1, 6, max_tokens=8)
    s.add(a)
    s.add(b)
    preempted, tokens, readmitted = [], 0, 0
    while s.has_unfinished:
        was_waiting = b.status is SequenceStatus.WAITING
        out = s.schedule()
        preempted += out.preempted
        for c in out.chunks:
            if c.seq is b and was_waiting and b.num_preemptions:
                readmitted += 1  # re-prefill covers its outputs, minus its cached pages
                assert c.start == b.num_cached_tokens and c.start + c.num_tokens == b.num_tokens
                assert b.num_tokens > 6 and (b.num_cached_tokens > 0) == caching
        sampled = [100 + c.seq.seq_id * 20 + c.seq.num_output_tokens for c in out.chunks]
        tokens += len(s.postprocess(out, sampled).new_tokens)
        check_pages(s)
    assert preempted and preempted[0] is b  # the newest running sequence
    assert b.num_preemptions >= 1 and a.num_preemptions == 0
    assert s.num_preemptions_total == len(preempted) == b.num_preemptions  # the run's count
    for q in (a, b):  # every token kept, none duplicated across the recompute
        assert q.output_token_ids == [100 + q.seq_id * 20 + i for i in range(8)]
        assert q.finish_reason == "length"
    assert tokens == 16 and s.block_manager.num_free_pages == 5 and readmitted >= 1


def test_pool_taken_by_outside_holder() -> None:
    """Pages borrowed outside the scheduler (e.g. the engine's prompt_logits) between steps:
    a stuck partial prefill is preempted, then a clear error, then recovery once returned."""
    s = make(page_size=4, num_pages=11, max_num_batched_tokens=8)
    a = seq(0, 20, max_tokens=4)
    s.add(a)
    step(s)
    assert a.num_computed_tokens == 8 and len(a.block_table) == 2
    holder = Sequence(-1, [1] * 32)
    s.block_manager.allocate(holder, 32)  # the 8 pages left
    with pytest.raises(RuntimeError, match="cannot admit"):
        s.schedule()
    assert a.status is SequenceStatus.WAITING and a.num_computed_tokens == 0
    assert a.block_table == [] and a.num_preemptions == 1 and s.block_manager.num_free_pages == 2
    s.block_manager.free(holder)
    out, _, _ = step(s)  # its 2 computed pages were still cached: recompute starts after them
    assert [(c.seq.seq_id, c.start, c.num_tokens) for c in out.chunks] == [(0, 8, 8)]
    assert a.num_cached_tokens == 8
    while s.has_unfinished:
        step(s)
    assert a.output_token_ids == [5] * 4 and s.block_manager.num_free_pages == 10


def test_abort_frees_pages_at_once() -> None:
    s = make(page_size=4)
    a, b = seq(0, 10), seq(1, 10)
    s.add(a)
    s.add(b)
    out = s.schedule()
    assert s.block_manager.num_free_pages == 63 - 6
    assert s.abort(0) is a and s.block_manager.num_free_pages == 63 - 3
    assert a.finish_reason == "abort" and a.is_finished and a.block_table == []
    new, fin = s.postprocess(out, [9, 9])  # the aborted sequence's result is dropped
    assert new == [(b, 9)] and fin == [] and a.output_token_ids == []
    s.add(c := seq(2, 10))
    assert s.abort(2) is c and s.num_waiting == 0 and s.abort(2) is None and s.abort(77) is None
    assert s.get(1) is b and s.get(0) is None


def test_fcfs_and_limits() -> None:
    s = make(max_num_seqs=5, max_prefill_seqs=3, max_num_batched_tokens=40,
             max_consecutive_prefills=None)  # v1 prefill-first
    for i in range(12):
        s.add(seq(i, 8))
    out = s.schedule()
    assert [c.seq.seq_id for c in out.chunks] == [0, 1, 2]  # max_prefill_seqs
    s.postprocess(out, [5] * 3)
    out = s.schedule()
    assert [c.seq.seq_id for c in out.chunks] == [3, 4]  # max_num_seqs running
    s.postprocess(out, [5] * 2)
    out = s.schedule()
    assert not out.is_prefill and len(out.chunks) == 5 and s.num_waiting == 7
    s2 = make(max_num_batched_tokens=20)
    for i in range(3):
        s2.add(seq(i, 8))
    out = s2.schedule()  # 8 + 8 + 4 (chunked) = the 20-token budget
    assert [(c.seq.seq_id, c.num_tokens) for c in out.chunks] == [(0, 8), (1, 8), (2, 4)]


def test_stop_rules() -> None:
    s = make(eos_token_ids=(EOS, 3))
    a = Sequence(0, [1, 2], SamplingParams(max_tokens=10, min_tokens=2))
    b = Sequence(1, [1, 2], SamplingParams(max_tokens=10, ignore_eos=True, stop_token_ids=[9]))
    c = Sequence(2, [1, 2], SamplingParams(max_tokens=2, ignore_eos=True))
    for q in (a, b, c):
        s.add(q)
    for toks in ([EOS, EOS, 7], [3, 3, 5], [9, 9]):
        out = s.schedule()
        s.postprocess(out, toks[:len(out.chunks)])
    assert (a.output_token_ids, a.finish_reason) == ([EOS, 3], "stop")  # min_tokens=2
    assert (b.output_token_ids, b.finish_reason) == ([EOS, 3, 9], "stop")  # ignores EOS
    assert (c.output_token_ids, c.finish_reason) == ([7, 5], "length")
    assert not s.has_unfinished


def test_request_errors() -> None:
    s = make(page_size=4, num_pages=5, max_model_len=32, max_queue_len=1,  # 16 slots
             max_num_seqs=1)
    with pytest.raises(RequestTooLongError, match=r"prompt \(30 tokens\) \+ max_tokens \(8\)"):
        s.add(seq(0, 30, max_tokens=8))
    with pytest.raises(RequestTooLongError, match="needs 5 KV pages"):
        s.add(seq(0, 10, max_tokens=8))  # 17 slots
    s.add(seq(0, 10, max_tokens=7))  # exactly 16 slots: accepted
    with pytest.raises(DuplicateRequestError):
        s.add(seq(0, 2))
    s.add(seq(1, 2))  # request 0 takes the one free place: 1 is queued
    with pytest.raises(QueueFullError, match="1 requests waiting for a place, max_queue_len "
                                             "is 1"):
        s.add(seq(2, 2))
    used = seq(3, 2)
    used.output_token_ids.append(4)
    with pytest.raises(SequenceStateError):
        s.add(used)
    out = s.schedule()
    s.postprocess(out, [5] * len(out.chunks))
    with pytest.raises(SequenceStateError, match="already postprocessed"):
        s.postprocess(out, [5] * len(out.chunks))
    with pytest.raises(ValueError, match="sampled tokens"):
        s.postprocess(s.schedule(), [])


@pytest.mark.parametrize("kw", [{"max_num_seqs": 0}, {"num_pages": 1},
                                {"max_num_batched_tokens": 2},
                                {"enable_chunked_prefill": False}, {"max_queue_len": 0},
                                {"eos_token_ids": (-1,)}, {"max_consecutive_prefills": 0},
                                {"max_consecutive_prefills": 1.5}])
def test_config_errors(kw: dict) -> None:
    with pytest.raises(ConfigError):
        make(**kw)


def plan(out: SchedulerOutput) -> tuple[str, list[tuple[int, int, int]]]:
    return ("P" if out.is_prefill else "D",
            [(c.seq.seq_id, c.start, c.num_tokens) for c in out.chunks])


@pytest.mark.parametrize("k", [None, 1, 2])
def test_alternation_keeps_decodes_flowing(k: int | None) -> None:
    """Two streams decode; a 100-token prompt arrives and is prefilled in 32-token chunks.
    k=None (v1): the streams stall for all 4 chunks. Else at most k prefill steps in a row
    while anything decodes, and the chunks still run in order to completion."""
    s = make(max_num_batched_tokens=32, max_consecutive_prefills=k)
    s.add(seq(0, 5, max_tokens=50))
    s.add(seq(1, 7, max_tokens=50))
    out, _, _ = step(s)
    assert plan(out) == ("P", [(0, 0, 5), (1, 0, 7)])
    out, _, _ = step(s)
    assert plan(out) == ("D", [(0, 5, 1), (1, 7, 1)])
    s.add(seq(2, 100, max_tokens=50))
    kinds = ""
    while s.get(2).num_output_tokens == 0:
        out, _, _ = step(s)
        kinds += plan(out)[0]
        if out.is_prefill:
            assert [c.seq.seq_id for c in out.chunks] == [2]
    expected = {None: "PPPP", 1: "PDPDPDP", 2: "PPDPP"}[k]
    assert kinds == expected
    out, _, _ = step(s)  # then all three decode together
    assert plan(out)[0] == "D" and [c.seq.seq_id for c in out.chunks] == [0, 1, 2]


def test_alternation_without_decodes_is_prefill_first() -> None:
    s = make(max_num_batched_tokens=32, max_consecutive_prefills=1)
    s.add(seq(0, 100))
    kinds = "".join(plan(step(s)[0])[0] for _ in range(4))
    assert kinds == "PPPP"  # nothing decodes: no decode step is forced


def test_prefix_hits_skip_cached_pages() -> None:
    """Shared system prompt, identical prompts, a prompt of exactly 4 pages: admission starts
    after the cached full pages (at most num_tokens - 1 tokens), which cost no budget."""
    s = make(page_size=4, max_num_batched_tokens=16)
    system = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]  # 14 tokens: 3 full pages
    sp = SamplingParams(max_tokens=3, ignore_eos=True)
    a = Sequence(0, system + [30, 31], sp)
    s.add(a)
    while s.has_unfinished:
        step(s)
    assert a.num_cached_tokens == 0 and s.block_manager.num_cached_pages == 4
    b = Sequence(1, system + [40, 41, 42], sp)  # shares 3 full pages with a
    c = Sequence(2, system + [30, 31], sp)  # identical to a: 16 tokens = exactly 4 pages
    s.add(b)
    s.add(c)
    out, _, _ = step(s)
    assert plan(out) == ("P", [(1, 12, 5), (2, 12, 4)])  # 9 tokens computed, not 33
    assert (b.num_cached_tokens, c.num_cached_tokens) == (12, 12)  # c recomputes its last page
    assert b.block_table[:3] == c.block_table[:3] and c.block_table[3] != b.block_table[3]
    assert [s.block_manager.ref_count[p] for p in b.block_table[:3]] == [2, 2, 2]
    check_pages(s)
    while s.has_unfinished:
        step(s)
        check_pages(s)
    assert s.block_manager.prefix_hit_tokens == 24
    d = Sequence(3, [99] + system, sp)  # same tokens shifted by one: no hit
    s.add(d)
    out, _, _ = step(s)
    assert plan(out) == ("P", [(3, 0, 15)]) and d.num_cached_tokens == 0
    off = make(page_size=4, enable_prefix_caching=False)
    for i in range(2):
        off.add(Sequence(i, system + [30, 31], sp))
        while off.has_unfinished:
            out, _, _ = step(off)
            assert all(c.start == 0 for c in out.chunks if c.num_tokens > 1)
    assert off.block_manager.prefix_hit_tokens == 0


def kv_waste_run(page_size: int, n_requests: int = 300, seed: int = 1) -> Sim:
    """A mixed-length workload (log-normal prompts, median ~90 tokens, up to 700; outputs
    uniform in 1..300) through the scheduler; ``stats.kv_waste`` = allocated-but-unused slots
    / allocated slots of the pages in use, averaged over steps."""
    cfg = SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=512, max_model_len=1024,
                          page_size=page_size, num_pages=1 + 16384 // page_size,
                          eos_token_ids=(EOS,))
    rng = random.Random(seed)
    sim = Sim(cfg, full_checks=False)  # a measurement; the invariants are tested above
    for i in range(n_requests):
        p = min(700, int(rng.lognormvariate(4.5, 1.0)) + 1)
        sp = SamplingParams(max_tokens=rng.randint(1, 300), ignore_eos=True)
        sim.add(Sequence(i, [rng.randrange(1, VOCAB) for _ in range(p)], sp))
    while sim.sched.has_unfinished:
        sim.step()
    sim.check_final()
    return sim


def test_kv_waste_mixed_lengths() -> None:
    """Allocated-but-unused KV slots / allocated slots over a mixed-length workload: only the
    last page of each sequence is partly empty, so waste stays under 4 % at 16-token pages."""
    rows = []
    for ps in (8, 16, 32):
        sim = kv_waste_run(ps)
        rows.append((ps, sim.stats.kv_waste, sim.stats.steps, sim.stats.preemptions))
    print("\nKV waste (allocated-but-unused / allocated slots, step-averaged):")
    for ps, w, steps, pre in rows:
        print(f"  page_size={ps:3d}: {100 * w:5.2f} %  ({steps} steps, {pre} preemptions)")
    waste = {ps: w for ps, w, _, _ in rows}
    assert 0.0 < waste[8] < waste[16] < waste[32] < 1.0
    assert waste[16] <= 0.04


# ---------------------------------------------------------------- n > 1 samples


def group(seq_id: int, length: int, n: int, max_tokens: int = 8) -> Sequence:
    """Sample 0 of a request for ``n`` samples (prompt as ``seq()``'s, EOS ignored)."""
    return Sequence(seq_id, seq(seq_id, length).prompt_token_ids,
                    SamplingParams(max_tokens=max_tokens, ignore_eos=True, n=n))



def test_fork_shares_prompt_pages_and_copies_the_partial_one() -> None:
    s = make(page_size=4, max_num_seqs=4)
    a = group(0, 10, 3, max_tokens=3)
    s.add(a)
    out, new, _ = step(s)  # the prompt up to its last token; nothing sampled
    assert plan(out) == ("P", [(0, 0, 9)]) and new == [] and not out.page_copies
    out = s.schedule()  # sample 0 forks: all three feed the last prompt token
    samples = a.group.samples
    assert [q.sample_index for q in samples] == [0, 1, 2] and s.running == samples
    assert plan(out) == ("D", [(0, 9, 1)] * 3) and [c.seq for c in out.chunks] == samples
    shared, last = a.block_table[:2], a.block_table[2]
    assert all(q.block_table[:2] == shared for q in samples)
    assert [(c.src, c.dst) for c in out.page_copies] == [
        (last, samples[1].block_table[2]), (last, samples[2].block_table[2])]
    bm = s.block_manager
    assert [bm.ref_count[p] for p in shared] == [3, 3] and bm.num_used_pages == 5
    check_pages(s)
    new, fin = s.postprocess(out, [5, 6, 7])
    assert [(q.sample_index, t) for q, t in new] == [(0, 5), (1, 6), (2, 7)] and not fin
    assert bm.num_cached_pages == 2  # the shared prompt pages, registered once
    while s.has_unfinished:
        out, _, fin = step(s, tok=8)
        check_pages(s)
        assert not out.page_copies
    assert [q.output_token_ids for q in samples] == [[5, 8, 8], [6, 8, 8], [7, 8, 8]]
    assert a.group.is_finished and s.get(0) is None and bm.num_free_pages == 63


@pytest.mark.parametrize("prompt_len, copies", [(9, 0), (1, 0), (6, 3)])
def test_fork_page_boundaries(prompt_len: int, copies: int) -> None:
    """9 tokens: 8 computed end a page, each sample takes a new page for the 9th; a 1-token
    prompt has nothing to prefill (admitted and forked in one decode step)."""
    s = make(page_size=4, max_num_seqs=4)
    a = group(0, prompt_len, 4, max_tokens=2)
    s.add(a)
    if prompt_len > 1:
        out, _, _ = step(s)
        assert plan(out) == ("P", [(0, 0, prompt_len - 1)])
    out = s.schedule()
    assert plan(out) == ("D", [(0, prompt_len - 1, 1)] * 4) and len(out.page_copies) == copies
    pages = [q.block_table[-1] for q in a.group.samples]
    assert len(set(pages)) == 4  # every sample writes its own page
    check_pages(s)
    s.postprocess(out, [5] * 4)
    while s.has_unfinished:
        step(s)
        check_pages(s)
    assert all(q.output_token_ids == [5, 5] for q in a.group.samples)


def test_samples_hold_places_and_pages_from_admission() -> None:
    # max_num_seqs 4: a 3-sample request holds 3 places before it forks, so a 2-sample one
    # waits for them; a 1-sample one fits beside it.
    s = make(page_size=4, max_num_seqs=4, max_consecutive_prefills=None)
    a, b, c = group(0, 6, 3, max_tokens=2), group(1, 6, 2, max_tokens=2), seq(2, 6, max_tokens=2)
    for q in (a, b, c):
        s.add(q)
    out, _, _ = step(s)
    assert plan(out) == ("P", [(0, 0, 5)]) and s.num_waiting == 2  # b does not fit: FCFS stop
    out, _, _ = step(s)
    assert plan(out) == ("D", [(0, 5, 1)] * 3)
    while not b.output_token_ids:
        step(s)
    assert a.group.is_finished
    # Pages: 2 full + partial prompt pages for 5 computed tokens of a 9-token prompt, plus a
    # copy per extra sample, must be free at admission.
    s2 = make(page_size=4, num_pages=6, max_num_seqs=4)  # 5 usable pages
    s2.add(seq(0, 9, max_tokens=1))  # holds 3 pages once admitted
    s2.add(d := group(1, 7, 2, max_tokens=1))  # needs 2 + 1 pages: waits
    out, _, _ = step(s2)
    assert plan(out) == ("P", [(0, 0, 9)]) and d.status is SequenceStatus.WAITING
    while s2.has_unfinished:
        step(s2)
        check_pages(s2)
    assert [len(q.output_token_ids) for q in d.group.samples] == [1, 1]


def test_abort_and_finish_of_samples() -> None:
    s = make(page_size=4)
    a = group(0, 10, 3, max_tokens=5)
    s.add(a)
    step(s)
    step(s)  # forked, each sample has one token
    bm = s.block_manager
    one, two = a.group.samples[1:]
    s.finish_sample(one, "stop")
    assert one.finish_reason == "stop" and not one.block_table and s.get(0) is a
    assert [bm.ref_count[p] for p in a.block_table[:2]] == [2, 2]
    s.finish_sample(one, "stop")  # already finished: nothing happens
    with pytest.raises(SequenceStateError, match="not scheduled here"):
        s.finish_sample(seq(9, 3), "stop")
    assert s.abort(0) is a and a.group.is_finished and bm.num_free_pages == 63
    assert (a.finish_reason, two.finish_reason) == ("abort", "abort") and s.get(0) is None
    b = group(1, 10, 3, max_tokens=5)  # aborted before it forks: only sample 0 ever existed
    s.add(b)
    step(s)
    assert s.abort(1) is b and b.group.samples == [b] and bm.num_free_pages == 63
    with pytest.raises(TooManySamplesError, match="n = 5 samples.*max_num_seqs = 4"):
        s.add(group(2, 3, 5))


def test_forked_samples_are_preempted_and_recomputed_alone() -> None:
    """A pool too small for everything at full length: the newest sample is preempted, comes
    back through the prefix cache (its siblings hold the prompt pages) and ends with the
    outputs it would have had without preemption."""
    s = make(page_size=4, num_pages=13, max_model_len=24)  # 12 usable pages
    b = seq(1, 9, max_tokens=12)  # 5 pages at full length
    a = group(0, 9, 3, max_tokens=12)  # 2 shared pages + 3 x 3 = 11
    s.add(b)
    s.add(a)
    preempted = []
    while s.has_unfinished:
        out = s.schedule()
        preempted += out.preempted
        s.postprocess(out, [10 + c.seq.seq_id * 50 + c.seq.sample_index * 20
                            + c.seq.num_output_tokens for c in out.chunks])
        check_pages(s)
    assert preempted and preempted[0] is a.group.samples[2]  # the newest: last sample
    for q in [b, *a.group.samples]:
        assert q.output_token_ids == [10 + q.seq_id * 50 + q.sample_index * 20 + i
                                      for i in range(12)]
    assert any(q.num_cached_tokens >= 8 for q in preempted)  # prompt pages from the cache
    assert s.block_manager.num_free_pages == 12
