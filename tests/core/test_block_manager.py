"""Page allocator: exact arithmetic, errors, and invariants under random workloads."""

from __future__ import annotations

import random
import subprocess
import sys
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxinfer.block_manager import (
    NO_MATCH,
    NULL_PAGE,
    BlockManager,
    OutOfPagesError,
    PageAccountingError,
)
from jaxinfer.sequence import InvalidPromptError, Sequence


def check_pages(bm: BlockManager, seqs: list[Sequence]) -> None:
    """No page leaked or owned twice by one sequence, null page never handed out, reference
    counts exact (= block tables holding the page), cache map consistent with the pages."""
    owned = Counter(p for s in seqs for p in s.block_table)
    free = bm.free_page_ids()
    assert NULL_PAGE not in owned and NULL_PAGE not in free
    for s in seqs:
        assert len(s.block_table) == len(set(s.block_table)), "a page twice in one table"
    assert len(free) == len(set(free)) == bm.num_free_pages
    assert not set(owned) & set(free), "a page is both owned and free"
    assert set(owned) | set(free) == set(range(1, bm.num_pages)), "a page leaked"
    for p, n in owned.items():
        assert bm.ref_count[p] == n
    for p in free:
        assert bm.ref_count[p] == 0
    assert bm.ref_count[NULL_PAGE] == 1
    evictable = set(bm.evictable_page_ids())
    for p in free:  # a free page is evictable exactly when it still holds a cached prefix
        assert (bm.page_hash[p] is not None) == (p in evictable)
    hashed = {bm.page_hash[p]: p for p in range(1, bm.num_pages) if bm.page_hash[p] is not None}
    assert len(hashed) == bm.num_cached_pages and hashed == bm._cached


def test_no_jax_import() -> None:
    code = ("import sys, jaxinfer.sequence, jaxinfer.block_manager, jaxinfer.scheduler; "
            "sys.exit(1 if 'jax' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_allocate_exact_pages_and_free() -> None:
    bm = BlockManager(num_pages=6, page_size=4)  # 5 usable pages
    s = Sequence(1, list(range(1, 11)))  # 10 tokens
    assert bm.num_free_pages == 5 and bm.num_usable_pages == 5
    assert bm.pages_needed(s, 10) == 3 and bm.pages_needed(s, 0) == 0
    bm.allocate(s, 5)  # tokens [0, 5): 2 pages
    assert len(s.block_table) == 2 and bm.num_free_pages == 3
    s.num_computed_tokens = 5
    assert bm.pages_needed(s, 3) == 0  # 8 tokens still fit in 2 pages
    assert bm.pages_needed(s, 4) == 1  # 9 tokens need a third
    bm.allocate(s, 3)
    assert len(s.block_table) == 2
    bm.allocate(s, 5)  # 10 tokens -> 3 pages
    assert len(s.block_table) == 3 and bm.num_used_pages == 3
    check_pages(bm, [s])
    bm.free(s)
    assert s.block_table == [] and bm.num_free_pages == 5
    check_pages(bm, [s])


@pytest.mark.parametrize("page_size", [1, 3, 4])
def test_has_room_is_pages_needed_zero(page_size: int) -> None:
    # The scheduler's decode step asks has_room instead of the allocator when a sequence's
    # block table already holds the fed token: both must be the block manager's one rule.
    bm = BlockManager(num_pages=40, page_size=page_size)
    for computed in range(0, 13):
        for held in range(0, 6):
            s = Sequence(1, list(range(1, 14)))
            bm.allocate(s, held * page_size)
            s.num_computed_tokens = computed
            for new in range(0, 6):
                need = bm.pages_needed(s, new)
                assert bm.has_room(s, new) == (need == 0), (computed, held, new)
                assert bm.has_room(s, new) == (held * page_size >= computed + new)
            bm.free(s)


def test_out_of_pages_is_all_or_nothing() -> None:
    bm = BlockManager(num_pages=4, page_size=2)  # 3 usable pages = 6 slots
    a, b = Sequence(1, [5] * 4), Sequence(2, [6] * 4)
    bm.allocate(a, 4)
    assert not bm.can_allocate(b, 4) and bm.can_allocate(b, 2)
    with pytest.raises(OutOfPagesError, match="sequence 2 needs 2 more pages"):
        bm.allocate(b, 4)
    assert b.block_table == [] and bm.num_free_pages == 1
    check_pages(bm, [a, b])


def test_null_page_and_double_free() -> None:
    bm = BlockManager(num_pages=3, page_size=1)
    s = Sequence(1, [1, 2])
    bm.allocate(s, 2)
    assert sorted(s.block_table) == [1, 2]
    t = Sequence(2, [1])
    assert not bm.can_allocate(t, 1)
    stale = list(s.block_table)
    bm.free(s)
    t.block_table = stale  # pretend t still held them: a bookkeeping bug
    with pytest.raises(PageAccountingError, match="not allocated"):
        bm.free(t)
    assert bm.num_free_pages == 2  # nothing changed by the failed free
    t.block_table = [NULL_PAGE]
    with pytest.raises(PageAccountingError, match="page 0"):
        bm.free(t)


@pytest.mark.parametrize("kw", [{"num_pages": 1, "page_size": 4},
                                {"num_pages": 8, "page_size": 0},
                                {"num_pages": True, "page_size": 4}])
def test_bad_arguments(kw: dict) -> None:
    with pytest.raises(ValueError, match="num_pages|page_size"):
        BlockManager(**kw)


def test_bad_prompt() -> None:
    with pytest.raises(InvalidPromptError, match="empty"):
        Sequence(3, [])
    with pytest.raises(InvalidPromptError, match="-1"):
        Sequence(3, [1, -1])


# A workload: (op, sequence index, token count). op 0 = grow by n tokens, 1 = free.
ops_strategy = st.lists(st.tuples(st.integers(0, 1), st.integers(0, 7), st.integers(0, 40)),
                        max_size=200)


@settings(max_examples=300, deadline=None, database=None)
@given(num_pages=st.integers(2, 40), page_size=st.integers(1, 16), ops=ops_strategy)
def test_random_workload_invariants(num_pages: int, page_size: int,
                                    ops: list[tuple[int, int, int]]) -> None:
    bm = BlockManager(num_pages, page_size)
    seqs = [Sequence(i, [1]) for i in range(8)]
    for op, i, n in ops:
        s = seqs[i]
        if op == 0:
            need = -(-(s.num_computed_tokens + n) // page_size) - len(s.block_table)
            assert bm.pages_needed(s, n) == max(0, need)
            free_before = bm.num_free_pages
            if bm.can_allocate(s, n):
                bm.allocate(s, n)
                s.num_computed_tokens += n
                assert len(s.block_table) == -(-s.num_computed_tokens // page_size)
                assert bm.num_free_pages == free_before - max(0, need)
            else:
                assert need > free_before
                with pytest.raises(OutOfPagesError):
                    bm.allocate(s, n)
                assert bm.num_free_pages == free_before
        else:
            held = len(s.block_table)
            free_before = bm.num_free_pages
            bm.free(s)
            s.num_computed_tokens = 0
            assert bm.num_free_pages == free_before + held
        check_pages(bm, seqs)
    for s in seqs:
        bm.free(s)
    assert bm.num_free_pages == num_pages - 1
    check_pages(bm, seqs)


# ---------------------------------------------------------------- prefix caching


def compute(bm: BlockManager, s: Sequence, n: int, kv: list[int] | None = None) -> None:
    """Allocate and 'compute' the next n tokens of s (writing token ids into a fake KV)."""
    bm.allocate(s, n)
    if kv is not None:
        toks = s.all_token_ids
        for pos in range(s.num_computed_tokens, s.num_computed_tokens + n):
            kv[s.block_table[pos // bm.page_size] * bm.page_size + pos % bm.page_size] = toks[pos]
    s.num_computed_tokens += n
    bm.register_computed_pages(s)


def admit(bm: BlockManager, s: Sequence) -> int:
    m = bm.match_prefix(s)
    bm.take_prefix(s, m)
    s.num_computed_tokens = m.num_tokens
    return m.num_tokens


def test_prefix_hit_shares_full_computed_pages() -> None:
    bm = BlockManager(num_pages=20, page_size=4)
    a = Sequence(1, list(range(10, 20)))  # 10 tokens: 2 full pages + 2 tokens
    compute(bm, a, 10)
    assert bm.num_cached_pages == 2  # the partial third page is not registered
    b = Sequence(2, list(range(10, 18)) + [99, 98, 97])  # shares 8 tokens, then differs
    assert admit(bm, b) == 8 and b.block_table == a.block_table[:2]
    assert [bm.ref_count[p] for p in a.block_table] == [2, 2, 1]
    c = Sequence(3, list(range(10, 20)))  # identical prompt: both full pages
    assert admit(bm, c) == 8
    d = Sequence(4, list(range(10, 18)))  # 8 tokens: the last must be computed -> 1 page
    assert admit(bm, d) == 4 and d.block_table == a.block_table[:1]
    e = Sequence(5, list(range(11, 19)) + [1])  # different first page: no hit
    assert admit(bm, e) == 0 and e.block_table == []
    f = Sequence(6, [1, 2, 3, 4] + list(range(14, 18)) + [5])  # same 2nd page, other 1st
    assert admit(bm, f) == 0, "a page matched without its prefix (hash chain broken)"
    assert bm.prefix_hit_tokens == 20 and bm.prefix_query_tokens == 11 + 10 + 8 + 9 + 9
    check_pages(bm, [a, b, c, d, e, f])
    for s in (a, b, c, d):
        bm.free(s)
    check_pages(bm, [e, f])
    assert bm.num_evictable_pages == 2 and bm.num_free_pages == 19


def test_only_full_computed_pages_are_shared() -> None:
    bm = BlockManager(num_pages=20, page_size=4)
    a = Sequence(1, list(range(10, 22)))  # 12 tokens
    bm.allocate(a, 12)  # pages for all 12, but only 6 computed so far
    a.num_computed_tokens = 6
    assert bm.register_computed_pages(a) == 1
    b = Sequence(2, list(range(10, 22)))
    assert bm.match_prefix(b).num_tokens == 4
    a.num_computed_tokens = 12
    assert bm.register_computed_pages(a) == 2 and bm.register_computed_pages(a) == 0
    assert bm.match_prefix(b).num_tokens == 8  # 12 tokens: at most 11 from the cache
    # Decode grows a into a 4th page; it is shared once full and computed.
    a.output_token_ids += [40, 41, 42, 43]
    compute(bm, a, 3)
    assert bm.num_cached_pages == 3
    compute(bm, a, 1)
    assert bm.num_cached_pages == 4
    c = Sequence(3, a.all_token_ids + [7])
    assert bm.match_prefix(c).num_tokens == 16


def test_same_prefix_computed_twice_stays_private() -> None:
    bm = BlockManager(num_pages=10, page_size=2)
    a, b = Sequence(1, [5, 6, 7, 8, 9]), Sequence(2, [5, 6, 7, 8, 9])
    compute(bm, a, 3)
    compute(bm, b, 5)  # b computed the same pages at the same time: a's key was first
    compute(bm, a, 2)
    assert bm.num_cached_pages == 2 and {bm._cached[k] for k in a.page_hashes} == {
        a.block_table[0], b.block_table[1]}
    check_pages(bm, [a, b])
    bm.free(b)  # b's private duplicate page returns to the never-cached free list
    check_pages(bm, [a])
    assert bm.num_evictable_pages == 1


def test_lru_eviction_tail_first_and_fresh_pages_first() -> None:
    bm = BlockManager(num_pages=9, page_size=2)  # 8 usable pages
    a = Sequence(1, [1, 2, 3, 4, 5, 6, 7])  # 4 pages, 3 full
    b = Sequence(2, [11, 12, 13, 14, 15])  # 3 pages, 2 full
    compute(bm, a, 7)
    compute(bm, b, 5)
    pa, pb = list(a.block_table), list(b.block_table)
    bm.free(a)  # released first: evicted first, tail first
    bm.free(b)
    assert bm.evictable_page_ids() == [pa[2], pa[1], pa[0], pb[1], pb[0]]
    c = Sequence(3, [30] * 6)  # 3 pages: the 3 never-cached free pages, no eviction
    compute(bm, c, 6)
    assert bm.num_evictions == 0 and set(c.block_table) == {8, pa[3], pb[2]}
    d = Sequence(4, [40] * 4)  # 2 pages: evicts a's last two full pages
    compute(bm, d, 4)
    assert bm.num_evictions == 2 and set(d.block_table) == {pa[2], pa[1]}
    assert bm.match_prefix(Sequence(5, [1, 2, 3, 4, 5, 6, 9])).pages == [pa[0]]
    assert bm.match_prefix(Sequence(6, [11, 12, 13, 14, 0])).pages == pb[:2]
    hit = Sequence(7, [11, 12, 13, 14, 0])
    admit(bm, hit)  # takes b's pages out of the evictable set: never evicted while held
    e = Sequence(8, [50] * 2)
    compute(bm, e, 2)
    assert e.block_table == [pa[0]] and bm.num_free_pages == 0
    check_pages(bm, [c, d, hit, e])
    with pytest.raises(OutOfPagesError):
        bm.allocate(Sequence(9, [1]), 1)


def test_prefix_caching_off_and_reset() -> None:
    off = BlockManager(num_pages=10, page_size=2, enable_prefix_caching=False)
    a = Sequence(1, [1, 2, 3, 4, 5])
    compute(off, a, 5)
    assert off.num_cached_pages == 0 and off.match_prefix(Sequence(2, [1, 2, 3, 4, 5])) == NO_MATCH
    bm = BlockManager(num_pages=10, page_size=2)
    compute(bm, a := Sequence(1, [1, 2, 3, 4, 5]), 5)
    b = Sequence(2, [1, 2, 3, 4, 9])
    admit(bm, b)
    bm.free(a)
    bm.reset_prefix_cache()  # b still holds the two shared pages: they stay cached
    assert bm.num_evictable_pages == 0 and bm.num_cached_pages == 2
    check_pages(bm, [b])


def test_match_prefix_with_pages_in_flight() -> None:
    """``filling``: keys of pages a step in flight fills extend the match as pages in use
    (None), which pages_to_admit counts as neither fresh nor evictable."""
    bm = BlockManager(num_pages=10, page_size=2)
    a = Sequence(1, [1, 2, 3, 4, 5])  # pages [1,2] [3,4] cached, [5] partial
    compute(bm, a, 5)
    bm.free(a)  # both cached pages evictable now
    head = Sequence(2, [1, 2, 3, 4, 5, 6, 7, 8, 9])  # 5 pages, 4 full before its last token
    plain = bm.match_prefix(head)
    assert plain.num_tokens == 4 and None not in plain.pages
    third = bm.page_hashes(head)[2]  # the page [5, 6]: not cached, being filled
    m = bm.match_prefix(head, filling={third})
    assert m.pages == plain.pages + [None] and m.num_tokens == 6
    # 5 pages for 9 tokens: 2 fresh + the 2 evictable cached pages; the one in flight is free
    assert bm.pages_to_admit(head, m, 9) == 2 + 2
    assert bm.pages_to_admit(head, plain, 9) == 3 + 2
    assert bm.match_prefix(head, filling={bm.page_hashes(head)[3]}) == plain  # not contiguous


def test_take_prefix_errors() -> None:
    bm = BlockManager(num_pages=10, page_size=2)
    a = Sequence(1, [1, 2, 3, 4, 5])
    compute(bm, a, 5)
    m = bm.match_prefix(Sequence(2, [1, 2, 3, 4, 5]))
    with pytest.raises(PageAccountingError, match="empty block table"):
        bm.take_prefix(a, m)
    other = Sequence(3, [7, 7, 7, 7, 7])
    with pytest.raises(PageAccountingError, match="does not cache"):
        bm.take_prefix(other, m)
    assert other.block_table == [] and [bm.ref_count[p] for p in m.pages] == [1, 1]


# A prefix-caching workload: (op, slot, n, family). op 0 = admit a new request in the slot
# (its prompt starts with one of 3 shared "system prompts"), 1 = compute n more tokens
# (decoding a token when the prompt is done), 2 = release (preempt: keeps tokens), 3 = re-admit.
pc_ops = st.lists(st.tuples(st.integers(0, 3), st.integers(0, 5), st.integers(1, 12),
                            st.integers(0, 2)), max_size=150)


def run_prefix_workload(num_pages: int, page_size: int, ops: list, seed: int) -> BlockManager:
    """Random admissions (with shared system prompts), computation, preemption and
    re-admission; every invariant checked after every operation."""
    rng = random.Random(seed)
    bm = BlockManager(num_pages, page_size)
    systems = [[rng.randrange(1, 4) for _ in range(rng.randint(0, 20))] for _ in range(3)]
    kv = [-1] * (num_pages * page_size)
    slots: list[Sequence] = [Sequence(100 + i, [1]) for i in range(6)]  # placeholders
    admitted = [False] * len(slots)
    release_key: dict[int, int] = {}  # page -> when it was released (eviction order spec)
    clock, next_id = 0, 0

    def release(i: int) -> None:
        nonlocal clock
        s, admitted[i] = slots[i], False
        before = list(s.block_table)
        bm.free(s)
        s.num_computed_tokens = 0
        for p in reversed(before):  # tail first
            if bm.ref_count[p] == 0:
                clock += 1
                release_key[p] = clock

    def checked_compute(s: Sequence, n: int) -> None:
        evictable_before = bm.evictable_page_ids()
        plain_before = bm.num_free_pages - len(evictable_before)
        need = bm.pages_needed(s, n)
        compute(bm, s, n, kv)
        still = set(bm.evictable_page_ids())
        gone = [p for p in evictable_before if p not in still]
        assert len(gone) == max(0, need - plain_before), "evicted before fresh pages ran out"
        oldest = sorted(evictable_before, key=release_key.__getitem__)[:len(gone)]
        assert sorted(gone) == sorted(oldest), "eviction is not least-recently-released"

    def admit_checked(i: int) -> None:
        s = slots[i]
        m = bm.match_prefix(s)
        assert m.num_tokens <= s.num_tokens - 1 and m.num_tokens == len(m.pages) * page_size
        if bm.pages_to_admit(s, m, m.num_tokens) > bm.num_free_pages:
            return
        admit(bm, s)
        admitted[i] = True
        toks = s.all_token_ids
        for pos in range(m.num_tokens):  # a hit page holds exactly this prefix's tokens
            assert kv[s.block_table[pos // page_size] * page_size + pos % page_size] == toks[pos]

    for op, i, n, fam in ops:
        s = slots[i]
        if op == 0:
            release(i)
            prompt = systems[fam][:rng.randint(0, len(systems[fam]))]
            prompt += [rng.randrange(1, 3) for _ in range(rng.randint(1, 6))]
            slots[i] = Sequence(next_id, prompt)
            next_id += 1
            admit_checked(i)
        elif op == 1 and admitted[i]:
            if s.num_computed_tokens == s.num_tokens:
                s.output_token_ids.append(rng.randrange(1, 3))
            n = min(n, s.num_tokens - s.num_computed_tokens)
            if bm.can_allocate(s, n):
                checked_compute(s, n)
        elif op == 2:
            release(i)
        elif op == 3 and not admitted[i]:
            admit_checked(i)
        check_pages(bm, slots)
    for i in range(len(slots)):
        release(i)
    assert bm.num_free_pages == num_pages - 1
    check_pages(bm, slots)
    return bm


@settings(max_examples=300, deadline=None, database=None)
@given(num_pages=st.integers(2, 30), page_size=st.sampled_from([1, 2, 3, 4, 8]), ops=pc_ops,
       seed=st.integers(0, 2**16))
def test_random_workload_with_prefix_caching(num_pages: int, page_size: int, ops: list,
                                             seed: int) -> None:
    run_prefix_workload(num_pages, page_size, ops, seed)


def test_random_prefix_workload_hits_and_evicts() -> None:
    """The workload above does exercise hits and evictions (not a vacuous property test)."""
    rng = random.Random(0)
    hits = evictions = 0
    for k in range(60):
        ops = [(rng.choice([0, 1, 1, 1, 2, 3]), rng.randrange(6), rng.randint(1, 12),
                rng.randrange(3)) for _ in range(150)]
        bm = run_prefix_workload(rng.randint(8, 30), rng.choice([1, 2, 4]), ops, k)
        hits += bm.prefix_hit_tokens
        evictions += bm.num_evictions
    assert hits > 100 and evictions > 20, (hits, evictions)


# ---------------------------------------------------------------- fork (n > 1 samples)


def test_fork_shares_full_pages_and_copies_the_partial_one() -> None:
    bm = BlockManager(num_pages=12, page_size=4)
    prompt = list(range(10, 20))  # 10 tokens
    a = Sequence(1, prompt)
    compute(bm, a, 9)  # up to the last prompt token: 2 full pages + 1 token
    assert bm.num_cached_pages == 2
    b = Sequence(1, prompt, sample_index=1)
    copy = bm.fork(a, b)
    assert copy is not None and copy.src == a.block_table[2] and copy.dst == b.block_table[2]
    assert b.block_table[:2] == a.block_table[:2] and copy.dst != copy.src
    assert [bm.ref_count[p] for p in a.block_table] == [2, 2, 1]
    assert b.num_computed_tokens == 9 and b.num_registered_pages == 2
    assert bm.num_cached_pages == 2  # the shared pages stay registered once
    check_pages(bm, [a, b])
    # Aligned: 8 computed tokens end on a page boundary, nothing to copy.
    c, d = Sequence(2, prompt[:9]), Sequence(2, prompt[:9], sample_index=1)
    compute(bm, c, 8)
    assert bm.fork(c, d) is None and d.block_table == c.block_table
    assert bm.num_cached_pages == 2  # c's pages hold the same prefix: they stay private
    check_pages(bm, [a, b, c, d])
    for s in (a, b, c, d):
        bm.free(s)
    assert bm.num_free_pages == 11
    check_pages(bm, [a, b, c, d])


def test_fork_errors_change_nothing() -> None:
    bm = BlockManager(num_pages=4, page_size=4)  # 3 usable pages
    a = Sequence(1, [5] * 10)
    compute(bm, a, 9)  # all 3 pages, the last one partial
    b = Sequence(1, [5] * 10, sample_index=1)
    with pytest.raises(OutOfPagesError, match="no free page"):
        bm.fork(a, b)
    assert b.block_table == [] and [bm.ref_count[p] for p in a.block_table] == [1, 1, 1]
    bm.free(a)
    a.num_computed_tokens = 0
    bm.allocate(a, 5)  # 2 pages for 0 computed tokens
    with pytest.raises(PageAccountingError, match="exactly its 0 computed"):
        bm.fork(a, b)
    bm.free(a)
    compute(bm, a, 4)
    b.block_table.append(1)
    with pytest.raises(PageAccountingError, match="empty block table"):
        bm.fork(a, b)
    with pytest.raises(PageAccountingError, match="into a sample of 2 tokens"):
        bm.fork(a, Sequence(1, [5, 5], sample_index=1))


# A fork workload over 6 slots of one prompt: (op, slot, other slot, n). op 0 = compute n more
# tokens of a slot, 1 = free it (preempt or finish), 2 = fork the slot into the other (empty) one.
fork_ops = st.lists(st.tuples(st.integers(0, 2), st.integers(0, 5), st.integers(0, 5),
                              st.integers(1, 9)), max_size=120)


def run_fork_workload(num_pages: int, page_size: int, ops: list, caching: bool) -> int:
    """Random computation, forks (with their page copies run on a fake KV) and frees; after
    every operation: pages partition the pool, reference counts are exact, no page is written
    while shared, and every sequence reads its own tokens back through its block table.
    Returns how many copies ran."""
    bm = BlockManager(num_pages, page_size, enable_prefix_caching=caching)
    prompt = [1 + i % 7 for i in range(60)]
    slots = [Sequence(0, prompt, sample_index=i) for i in range(6)]
    kv = [-1] * (num_pages * page_size)
    copies = 0

    def read_back(s: Sequence) -> None:
        for pos in range(s.num_computed_tokens):
            page = s.block_table[pos // page_size]
            assert kv[page * page_size + pos % page_size] == prompt[pos], (s, pos)

    for op, i, j, n in ops:
        s = slots[i]
        if op == 0:
            n = min(n, s.num_tokens - s.num_computed_tokens)
            if not bm.can_allocate(s, n):
                continue
            bm.allocate(s, n)
            for pos in range(s.num_computed_tokens, s.num_computed_tokens + n):
                assert bm.ref_count[s.block_table[pos // page_size]] == 1, "write to a shared page"
            compute_kv = s.num_computed_tokens
            for pos in range(compute_kv, compute_kv + n):
                kv[s.block_table[pos // page_size] * page_size + pos % page_size] = prompt[pos]
            s.num_computed_tokens += n
            bm.register_computed_pages(s)
        elif op == 1:
            held = Counter(s.block_table)
            free_before = bm.num_free_pages
            bm.free(s)
            s.num_computed_tokens = 0
            assert bm.num_free_pages == free_before + sum(bm.ref_count[p] == 0 for p in held)
        elif i != j and not slots[j].block_table:
            t = slots[j]
            t.num_computed_tokens = 0
            free_before, partial = bm.num_free_pages, s.num_computed_tokens % page_size != 0
            if partial and not free_before:
                with pytest.raises(OutOfPagesError):
                    bm.fork(s, t)
                assert not t.block_table
            else:
                copy = bm.fork(s, t)
                assert (copy is not None) == partial
                assert bm.num_free_pages == free_before - partial
                if copy is not None:  # the engine copies on the device before the next step
                    kv[copy.dst * page_size:(copy.dst + 1) * page_size] = \
                        kv[copy.src * page_size:(copy.src + 1) * page_size]
                    copies += 1
        check_pages(bm, slots)
        for t in slots:
            read_back(t)
    for s in slots:
        bm.free(s)
    assert bm.num_free_pages == num_pages - 1
    check_pages(bm, slots)
    return copies


@settings(max_examples=300, deadline=None, database=None)
@given(num_pages=st.integers(2, 30), page_size=st.sampled_from([1, 2, 3, 4, 8]), ops=fork_ops,
       caching=st.booleans())
def test_random_fork_workload(num_pages: int, page_size: int, ops: list, caching: bool) -> None:
    run_fork_workload(num_pages, page_size, ops, caching)


def test_random_fork_workload_copies() -> None:
    """The fork workload does fork partial pages (not a vacuous property test)."""
    rng = random.Random(0)
    copies = sum(run_fork_workload(20, 4, [(rng.choice([0, 0, 1, 2, 2]), rng.randrange(6),
                                            rng.randrange(6), rng.randint(1, 9))
                                           for _ in range(120)], k % 2 == 0)
                 for k in range(30))
    assert copies > 50, copies
