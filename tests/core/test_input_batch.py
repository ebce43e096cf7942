"""``InputBatch.build_decode`` (persistent per-slot rows, vectorized) builds exactly the
decode step ``build_step`` builds row by row, over random runs: ragged lengths, page
boundaries, block tables longer than needed, n > 1 samples, penalties, logprobs, seeds,
slots released and handed out again (preemption, finish), and steps it must leave to
``build_step``."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from jaxinfer.batch import SlotTable, build_step
from jaxinfer.input_batch import InputBatch
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.scheduler_types import ScheduledChunk
from jaxinfer.sequence import Sequence

PAGE_BUCKETS = (2, 4, 8, 16)
SEQ_BUCKETS = (1, 2, 4, 8, 16, 32)


def _params(rng) -> SamplingParams:
    kw = {}
    if rng.random() < 0.5:
        kw.update(temperature=float(rng.choice([0.0, 0.5, 1.3])),
                  top_k=int(rng.choice([-1, 0, 5])), top_p=float(rng.choice([1.0, 0.8])),
                  min_p=float(rng.choice([0.0, 0.1])))
    if rng.random() < 0.4:
        kw.update(repetition_penalty=1.2, presence_penalty=-0.5, frequency_penalty=0.3)
    if rng.random() < 0.3:
        kw.update(logprobs=int(rng.integers(0, 4)))
    if rng.random() < 0.5:
        kw.update(seed=int(rng.integers(0, 2**63)))
    return SamplingParams(max_tokens=100, n=int(rng.choice([1, 1, 3])), **kw)


def _assert_same(fast, ref) -> None:
    assert fast.bucket == ref.bucket
    for name in ("token_ids", "positions", "slot_mapping", "seq_ids", "block_tables",
                 "seq_lens", "logits_indices"):
        a, b = getattr(fast, name), getattr(ref, name)
        assert a.dtype == b.dtype and np.array_equal(a, b), name
    for name, a, b in zip(fast.sampling._fields, fast.sampling, ref.sampling):
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b), name


class _World:
    """Running sequences with growing tokens and block tables, holding slots as the engine
    assigns them (a fresh slot on (re)admission, released on preemption and finish)."""

    def __init__(self, rng, ps: int, num_slots: int = 32) -> None:
        self.rng, self.ps = rng, ps
        self.slots = SlotTable(num_slots)
        self.rows = InputBatch(self.slots, page_size=ps, max_pages=PAGE_BUCKETS[-1])
        self.seeds: dict[int, int] = {}
        self.running: list[Sequence] = []
        self.next_id = 0
        self.next_page = 1

    def _pages(self, k: int) -> list[int]:
        self.next_page += k
        return list(range(self.next_page - k, self.next_page))

    def _fit(self, seq: Sequence, extra: int = 0) -> None:
        """Grow the block table to hold every token (sometimes a page or two more)."""
        need = -(-seq.num_tokens // self.ps) + extra
        if need > len(seq.block_table):
            seq.block_table += self._pages(need - len(seq.block_table))

    def add(self) -> None:
        rng, sp = self.rng, _params(self.rng)
        rid, self.next_id = self.next_id, self.next_id + 1
        prompt = rng.integers(0, 96, int(rng.integers(1, 3 * self.ps))).tolist()
        first = Sequence(rid, prompt, sp)
        self.seeds[rid] = int(rng.integers(0, 2**63))
        for seq in [first] + [first.fork(i) for i in range(1, sp.n)]:
            seq.output_token_ids = rng.integers(0, 96, int(rng.integers(0, 3))).tolist()
            self._fit(seq, int(rng.integers(0, 2)) if rng.random() < 0.2 else 0)
            self.slots.assign(seq.key)
            self.running.append(seq)

    def churn(self) -> None:
        rng = self.rng
        for seq in list(self.running):
            u = rng.random()
            if u < 0.05:  # finish
                self.running.remove(seq)
                self.slots.release(seq.key)
            elif u < 0.12:  # preempt and readmit at once (often the same slot, fresh pages)
                self.slots.release(seq.key)
                seq.block_table.clear()
                self._fit(seq)
                self.slots.assign(seq.key)
            else:
                seq.output_token_ids.append(int(rng.integers(0, 96)))
                self._fit(seq)
        while len(self.running) + 3 <= self.slots.num_slots and rng.random() < 0.5:
            self.add()

    def step(self, chunks=None):
        chunks = chunks or [ScheduledChunk(s, s.num_tokens - 1, 1) for s in self.running]
        kw = dict(seq_buckets=SEQ_BUCKETS, page_buckets=PAGE_BUCKETS, request_seeds=self.seeds)
        fast = self.rows.build_decode(chunks, **kw)
        ref = build_step(chunks, is_prefill=False, page_size=self.ps, token_buckets=SEQ_BUCKETS,
                         slots=self.slots.mapping, **kw)
        return fast, ref


@pytest.mark.parametrize("ps", [1, 2, 4, 16])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_decode_rows_equal_build_step_over_random_runs(ps, seed):
    world = _World(np.random.default_rng(seed), ps)
    for _ in range(4):
        world.add()
    built = 0
    for _ in range(60):
        world.churn()
        if not world.running:
            continue
        for s in list(world.running):  # finish those that outgrow the widest bucket
            if s.num_tokens > ps * PAGE_BUCKETS[-1]:
                world.running.remove(s)
                world.slots.release(s.key)
        order = world.rng.permutation(len(world.running))  # rows in any order
        chunks = [ScheduledChunk(world.running[i], world.running[i].num_tokens - 1, 1)
                  for i in order]
        if not chunks:
            continue
        fast, ref = world.step(chunks)
        assert fast is not None
        _assert_same(fast, ref)
        built += 1
    assert built > 30


def test_steps_left_to_build_step():
    rng = np.random.default_rng(3)
    world = _World(rng, 4)
    for _ in range(3):
        world.add()
    seq = world.running[0]
    ok = ScheduledChunk(seq, seq.num_tokens - 1, 1)
    assert world.step([ok])[0] is not None
    cases = {
        "two tokens": [ScheduledChunk(seq, seq.num_tokens - 2, 2)] if seq.num_tokens > 1 else [],
        "not sampling": [ScheduledChunk(seq, seq.num_tokens - 2, 1)] if seq.num_tokens > 1
        else [],
        "duck-typed chunk": [SimpleNamespace(seq=seq, start=seq.num_tokens - 1, num_tokens=1)],
        "no slot": [ScheduledChunk(Sequence(999, [1, 2, 3]), 2, 1)],
        "more rows than buckets": [ok] * (SEQ_BUCKETS[-1] + 1),
    }
    short = Sequence(998, [1, 2, 3, 4, 5])
    world.slots.assign(short.key)
    short.block_table = [7]  # the page of token 4 is missing
    cases["table too short"] = [ScheduledChunk(short, 4, 1)]
    for name, chunks in cases.items():
        if chunks:
            assert world.rows.build_decode(chunks, seq_buckets=SEQ_BUCKETS,
                                           page_buckets=PAGE_BUCKETS,
                                           request_seeds=world.seeds) is None, name


def test_a_row_is_rewritten_for_a_new_tenure_of_its_slot():
    """A slot released and handed out again, to another sequence or to the same one with a
    new block table of the same length, gets its row rewritten."""
    world = _World(np.random.default_rng(4), 4, num_slots=2)
    a = Sequence(0, [5, 6, 7, 8, 9], SamplingParams(temperature=0.7, seed=3))
    b = Sequence(1, [9, 8, 7, 6, 5], SamplingParams(temperature=0.0, repetition_penalty=1.5))
    world.seeds.update({0: 3, 1: 4})
    for seq in (a, b):
        world._fit(seq)
        world.slots.assign(seq.key)
        world.running = [seq]
        _assert_same(*world.step())
        world.slots.release(seq.key)
    world.running = [a]
    world.slots.assign(a.key)
    a.block_table = [p + 100 for p in a.block_table]  # same length, other pages
    _assert_same(*world.step())
