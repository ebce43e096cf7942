"""Host-side page allocator for the paged KV cache (vLLM's block manager; nano-vllm's
``BlockManager``). Plain Python; no JAX.

The device pool holds ``num_pages`` pages of ``page_size`` token slots each (layout in
``pallas_kernels/paged_attention/reference.py``). Page 0 is the reserved *null page*: padding
tokens write there and it is never handed out. A sequence owns the pages listed in its
``block_table``; pages are allocated on demand as its computed tokens grow and all returned
at once when it finishes, is aborted or is preempted.

Every page carries a reference count (0 = free, 1 = owned by one sequence). Prefix caching
(hashing full pages so that sequences share them) and copy-on-write will raise counts above
1 behind the same public methods: ``pages_needed`` / ``allocate`` will first look full prompt
pages up by hash, ``free`` already returns a page only when its count drops to 0.
"""

from __future__ import annotations

from collections import Counter, deque

from jaxinfer.sequence import Sequence

NULL_PAGE = 0


class OutOfPagesError(RuntimeError):
    """An allocation asked for more pages than are free."""


class PageAccountingError(RuntimeError):
    """A page was freed that is not allocated (a bookkeeping bug, never expected)."""


class BlockManager:
    """Allocates KV-cache pages to sequences.

    Args:
      num_pages: pages in the device pool, the null page 0 included (>= 2).
      page_size: token slots per page (>= 1).
    Raises:
      ValueError: on num_pages < 2 or page_size < 1.
    """

    def __init__(self, num_pages: int, page_size: int) -> None:
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 2:
            raise ValueError(f"BlockManager: num_pages must be an int >= 2 (null page "
                             f"included), got {num_pages!r}")
        if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"BlockManager: page_size must be an int >= 1, got {page_size!r}")
        self.num_pages = num_pages
        self.page_size = page_size
        # ref_count[p]: sequences holding page p. The null page is pinned at 1 forever.
        self.ref_count: list[int] = [0] * num_pages
        self.ref_count[NULL_PAGE] = 1
        # FIFO free list: pages freed longest ago are reused first (keeps hashed pages of
        # finished sequences alive longest once prefix caching is added).
        self._free: deque[int] = deque(range(1, num_pages))

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def num_usable_pages(self) -> int:
        """Pages that can ever be handed out (all but the null page)."""
        return self.num_pages - 1

    @property
    def num_used_pages(self) -> int:
        return self.num_usable_pages - len(self._free)

    def pages_for_tokens(self, num_tokens: int) -> int:
        """Pages that hold ``num_tokens`` tokens: ceil(num_tokens / page_size)."""
        return -(-num_tokens // self.page_size)

    def pages_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Extra pages ``seq`` needs so its block table holds
        ``seq.num_computed_tokens + num_new_tokens`` tokens (0 if it already does)."""
        if num_new_tokens < 0:
            raise ValueError(f"sequence {seq.seq_id}: num_new_tokens must be >= 0, "
                             f"got {num_new_tokens}")
        total = seq.num_computed_tokens + num_new_tokens
        return max(0, self.pages_for_tokens(total) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether enough pages are free for ``allocate(seq, num_new_tokens)``."""
        return self.pages_needed(seq, num_new_tokens) <= len(self._free)

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Append pages to ``seq.block_table`` so it holds ``num_computed_tokens +
        num_new_tokens`` tokens. All or nothing.

        Raises:
          OutOfPagesError: when fewer pages are free than needed (nothing is allocated).
        """
        need = self.pages_needed(seq, num_new_tokens)
        if need > len(self._free):
            raise OutOfPagesError(
                f"sequence {seq.seq_id} needs {need} more pages for "
                f"{seq.num_computed_tokens}+{num_new_tokens} tokens, {len(self._free)} free")
        for _ in range(need):
            page = self._free.popleft()
            self.ref_count[page] = 1
            seq.block_table.append(page)

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s hold on all its pages at once and clear its block table. A page
        returns to the free list when no sequence holds it any more.

        Raises:
          PageAccountingError: if a page in the block table is not allocated.
        """
        for page, n in Counter(seq.block_table).items():  # check all before changing any
            if not 0 < page < self.num_pages or self.ref_count[page] < n:
                raise PageAccountingError(
                    f"sequence {seq.seq_id}: freeing page {page}, which is not allocated")
        for page in reversed(seq.block_table):
            self.ref_count[page] -= 1
            if self.ref_count[page] == 0:
                self._free.append(page)
        seq.block_table.clear()

    def free_page_ids(self) -> list[int]:
        """The free pages (a copy; for tests and debugging)."""
        return list(self._free)
