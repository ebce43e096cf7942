"""Page allocator: exact arithmetic, errors, and invariants under random workloads."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxinfer.block_manager import NULL_PAGE, BlockManager, OutOfPagesError, PageAccountingError
from jaxinfer.sequence import InvalidPromptError, Sequence


def check_pages(bm: BlockManager, seqs: list[Sequence]) -> None:
    """No page leaked or owned twice, null page never handed out, ref counts exact."""
    owned = [p for s in seqs for p in s.block_table]
    free = bm.free_page_ids()
    assert NULL_PAGE not in owned and NULL_PAGE not in free
    assert len(owned) == len(set(owned)), "a page is owned twice"
    assert len(free) == len(set(free)) == bm.num_free_pages
    assert not set(owned) & set(free), "a page is both owned and free"
    assert set(owned) | set(free) == set(range(1, bm.num_pages)), "a page leaked"
    for p in owned:
        assert bm.ref_count[p] == 1
    for p in free:
        assert bm.ref_count[p] == 0


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
