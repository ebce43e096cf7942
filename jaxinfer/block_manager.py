"""Host-side page allocator for the paged KV cache, with automatic prefix caching (vLLM's
block manager / ``KVCacheManager``; nano-vllm's ``BlockManager``). Plain Python; no JAX.

The device pool holds ``num_pages`` pages of ``page_size`` token slots each (layout in
``pallas_kernels/paged_attention/reference.py``). Page 0 is the reserved *null page*: padding
tokens write there and it is never handed out. A sequence holds the pages listed in its
``block_table``; pages are allocated on demand as its computed tokens grow and all released
at once when it finishes, is aborted or is preempted.

Prefix caching (vLLM's automatic prefix caching, Kwon et al. 2023 §4.4; SGLang's RadixAttention
solves the same problem with a tree). A *full* page whose K/V are *computed* is registered
under the hash chain of its tokens: ``key_i = sha256(key_{i-1} || tokens of page i)``, so a key
names the whole prefix up to the end of page i, not just the page. A new sequence looks its
own chain up page by page and takes the longest run of cached pages into its block table
(reference count + 1) instead of recomputing them. Rules that keep this correct:

- only full pages whose K/V are computed are registered (``register_computed_pages`` after a
  step), so a page is never shared while it is written and never written once shared;
- at most ``num_tokens - 1`` tokens come from the cache: the last token is always computed,
  its logits give the next token;
- a page whose reference count drops to 0 keeps its K/V and its key (*evictable*); it is
  reused only when no never-cached free page is left, least recently released first (LRU).
  Pages of one sequence are released tail first, so a shared prefix outlives its suffixes.

Every page carries a reference count (0 = free, n = in n block tables). The null page is
pinned at 1. Shared pages are full and never written, with one exception that copy-on-write
handles: ``fork`` gives a new sample of an ``n > 1`` request every full page of its parent's
block table (reference count + 1) and, when the parent's last computed page is partial, a
fresh page of its own and a ``PageCopy`` (parent's page -> fresh page) that the engine runs on
the device before the step that writes into it. The fork comes right before that step (every
sample writes its next token into that page at once), so copying at the fork is copying at
the first write.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter, OrderedDict, deque
from collections.abc import Collection
from typing import NamedTuple

from jaxinfer.sequence import Sequence

NULL_PAGE = 0


class OutOfPagesError(RuntimeError):
    """An allocation asked for more pages than are free."""


class PageAccountingError(RuntimeError):
    """A page was freed that is not allocated (a bookkeeping bug, never expected)."""


class PrefixMatch(NamedTuple):
    """The cached prefix of a sequence: ``pages`` hold its first ``num_tokens`` tokens
    (``len(pages) * page_size``)."""

    pages: list[int | None]  # None: a page that a step in flight fills (match_prefix)
    num_tokens: int


NO_MATCH = PrefixMatch([], 0)


class PageCopy(NamedTuple):
    """Copy-on-write: the K/V of page ``src`` must be copied into page ``dst`` (on the
    device, every layer and head) before the next step runs."""

    src: int
    dst: int


def hash_page(parent: bytes, tokens: list[int]) -> bytes:
    """Key of a full page: sha256 of the parent page's key (b"" for page 0) and the page's
    token ids as little-endian int64. 32 bytes; collisions are not a practical concern."""
    return hashlib.sha256(parent + array("q", tokens).tobytes()).digest()


class BlockManager:
    """Allocates KV-cache pages to sequences and shares full prefix pages between them.

    Args:
      num_pages: pages in the device pool, the null page 0 included (>= 2).
      page_size: token slots per page (>= 1).
      enable_prefix_caching: register computed full pages and look prompts up (default on).
    Raises:
      ValueError: on num_pages < 2 or page_size < 1.
    """

    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True
                 ) -> None:
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 2:
            raise ValueError(f"BlockManager: num_pages must be an int >= 2 (null page "
                             f"included), got {num_pages!r}")
        if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"BlockManager: page_size must be an int >= 1, got {page_size!r}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        # ref_count[p]: block tables holding page p. The null page is pinned at 1 forever.
        self.ref_count: list[int] = [0] * num_pages
        self.ref_count[NULL_PAGE] = 1
        # page_hash[p]: key of the prefix page p holds (registered), else None.
        self.page_hash: list[bytes | None] = [None] * num_pages
        self._cached: dict[bytes, int] = {}  # key -> the page registered under it
        # Free pages: never-cached ones (FIFO) are used before evicting cached ones (LRU first).
        self._free: deque[int] = deque(range(1, num_pages))
        self._evictable: OrderedDict[int, None] = OrderedDict()
        # Counters (monotonic): prompt tokens looked up / found, cached pages evicted.
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0
        self.num_evictions = 0

    # ------------------------------------------------------------------ pool state
    @property
    def num_free_pages(self) -> int:
        """Pages an allocation may take: never-cached free pages plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_usable_pages(self) -> int:
        """Pages that can ever be handed out (all but the null page)."""
        return self.num_pages - 1

    @property
    def num_used_pages(self) -> int:
        return self.num_usable_pages - self.num_free_pages

    @property
    def num_cached_pages(self) -> int:
        """Pages registered in the prefix cache (in use or evictable)."""
        return len(self._cached)

    @property
    def num_evictable_pages(self) -> int:
        return len(self._evictable)

    def free_page_ids(self) -> list[int]:
        """The free pages, never-cached first, then evictable in eviction order (a copy)."""
        return list(self._free) + list(self._evictable)

    def evictable_page_ids(self) -> list[int]:
        """Free pages that still hold cached K/V, least recently released first (a copy)."""
        return list(self._evictable)

    def pages_for_tokens(self, num_tokens: int) -> int:
        """Pages that hold ``num_tokens`` tokens: ceil(num_tokens / page_size)."""
        return -(-num_tokens // self.page_size)

    # ------------------------------------------------------------------ allocation
    def has_room(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether ``seq``'s block table already holds ``seq.num_computed_tokens +
        num_new_tokens`` tokens: then ``pages_needed`` is 0 and ``allocate`` takes nothing.
        Unchecked (the scheduler asks it for every decoding sequence every step)."""
        return len(seq.block_table) * self.page_size >= seq.num_computed_tokens + num_new_tokens

    def pages_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Extra pages ``seq`` needs so its block table holds
        ``seq.num_computed_tokens + num_new_tokens`` tokens (0 if it already does:
        ``has_room``)."""
        if num_new_tokens < 0:
            raise ValueError(f"sequence {seq.seq_id}: num_new_tokens must be >= 0, "
                             f"got {num_new_tokens}")
        if self.has_room(seq, num_new_tokens):
            return 0
        return self.pages_for_tokens(seq.num_computed_tokens + num_new_tokens) - len(
            seq.block_table)

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether enough pages are free for ``allocate(seq, num_new_tokens)``."""
        return self.pages_needed(seq, num_new_tokens) <= self.num_free_pages

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Append pages to ``seq.block_table`` so it holds ``num_computed_tokens +
        num_new_tokens`` tokens. All or nothing. Takes never-cached free pages first, then
        evicts the least recently released cached page.

        Raises:
          OutOfPagesError: when fewer pages are free than needed (nothing is allocated).
        """
        need = self.pages_needed(seq, num_new_tokens)
        if need > self.num_free_pages:
            raise OutOfPagesError(
                f"sequence {seq.seq_id} needs {need} more pages for "
                f"{seq.num_computed_tokens}+{num_new_tokens} tokens, "
                f"{self.num_free_pages} free")
        for _ in range(need):
            if self._free:
                page = self._free.popleft()
            else:
                page, _ = self._evictable.popitem(last=False)
                del self._cached[self.page_hash[page]]  # type: ignore[arg-type]
                self.page_hash[page] = None
                self.num_evictions += 1
            self.ref_count[page] = 1
            seq.block_table.append(page)

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s hold on all its pages at once and clear its block table. A page is
        free when no block table holds it any more; registered pages stay cached
        (evictable), released tail first so the shared prefix is evicted last.

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
                if self.page_hash[page] is not None:
                    self._evictable[page] = None
                else:
                    self._free.append(page)
        seq.block_table.clear()
        seq.num_registered_pages = 0

    def fork(self, parent: Sequence, child: Sequence) -> PageCopy | None:
        """Give ``child`` (no pages yet, the same leading tokens: another sample of the same
        prompt) ``parent``'s computed tokens: every full page of
        ``parent``'s block table is shared (one more reference each) and a partial last page
        is copied into a fresh page of the child's. Also copies ``num_computed_tokens`` and
        the prefix-cache bookkeeping (the shared pages are registered once, by the parent).

        Returns the ``PageCopy`` the device must run before the next step, or None when
        the computed tokens end on a page boundary.
        Raises:
          OutOfPagesError: a partial page must be copied and no page is free (nothing
            changes).
          PageAccountingError: ``child`` holds pages, or ``parent``'s block table does not
            hold exactly its computed tokens.
        """
        computed, ps = parent.num_computed_tokens, self.page_size
        if child.block_table:
            raise PageAccountingError(f"sequence {child.seq_id}: fork needs an empty block "
                                      f"table, it holds {len(child.block_table)} pages")
        if computed > child.num_tokens:
            raise PageAccountingError(f"sequence {child.seq_id}: fork of {computed} computed "
                                      f"tokens into a sample of {child.num_tokens} tokens")
        if len(parent.block_table) != self.pages_for_tokens(computed):
            raise PageAccountingError(
                f"sequence {parent.seq_id}: fork needs a block table of exactly its "
                f"{computed} computed tokens, it holds {len(parent.block_table)} pages")
        n_full = computed // ps
        partial = n_full < len(parent.block_table)
        if partial and not self.num_free_pages:
            raise OutOfPagesError(f"sequence {parent.seq_id}: no free page to copy its "
                                  f"last page for sample {child.sample_index}")
        for page in parent.block_table[:n_full]:
            self.ref_count[page] += 1
            child.block_table.append(page)
        child.num_computed_tokens = computed
        child.page_hashes = list(parent.page_hashes[:n_full])
        child.num_registered_pages = min(parent.num_registered_pages, n_full)
        if not partial:
            return None
        self.allocate(child, 0)  # a fresh page for the computed tokens of the partial one
        return PageCopy(parent.block_table[n_full], child.block_table[n_full])

    # ------------------------------------------------------------------ prefix caching
    def page_hashes(self, seq: Sequence) -> list[bytes]:
        """Keys of ``seq``'s full pages (``num_tokens // page_size`` of them), computed
        incrementally and kept in ``seq.page_hashes``."""
        hashes, ps = seq.page_hashes, self.page_size
        n_full = seq.num_tokens // ps
        if len(hashes) < n_full:
            tokens = seq.all_token_ids
            for i in range(len(hashes), n_full):
                hashes.append(hash_page(hashes[-1] if hashes else b"",
                                        tokens[i * ps:(i + 1) * ps]))
        return hashes

    def match_prefix(self, seq: Sequence, filling: Collection[bytes] = ()) -> PrefixMatch:
        """Longest run of cached pages that starts ``seq`` (``seq`` holds no pages yet),
        leaving at least its last token to compute. Read-only; see ``take_prefix``.

        ``filling``: prefix keys of pages that a step in flight fills (registered when it is
        read back); they extend the run as pages in use, ``None`` in ``pages`` (such a match
        is for ``pages_to_admit`` only, not for ``take_prefix``)."""
        if not self.enable_prefix_caching or seq.block_table:
            return NO_MATCH
        limit = (seq.num_tokens - 1) // self.page_size
        pages: list[int | None] = []
        for key in self.page_hashes(seq)[:limit]:
            page = self._cached.get(key)
            if page is None and key not in filling:
                break
            pages.append(page)
        return PrefixMatch(pages, len(pages) * self.page_size)

    def cached_page(self, key: bytes) -> int | None:
        """The page registered under prefix key ``key`` (in use or evictable), or None."""
        return self._cached.get(key)

    def pages_to_admit(self, seq: Sequence, match: PrefixMatch, num_tokens: int) -> int:
        """Free pages consumed if ``seq`` takes ``match`` and then grows to ``num_tokens``
        tokens: fresh pages for the rest, plus matched pages that are now evictable."""
        fresh = max(0, self.pages_for_tokens(num_tokens) - len(match.pages))
        return fresh + sum(1 for p in match.pages if p is not None and self.ref_count[p] == 0)

    def take_prefix(self, seq: Sequence, match: PrefixMatch) -> None:
        """Put ``match.pages`` at the start of ``seq``'s (empty) block table, one more
        reference each. The caller sets ``seq.num_computed_tokens = match.num_tokens``.

        Raises:
          PageAccountingError: ``seq`` already holds pages, or a page is no longer cached.
        """
        if seq.block_table:
            raise PageAccountingError(f"sequence {seq.seq_id}: take_prefix needs an empty "
                                      f"block table, it holds {len(seq.block_table)} pages")
        keys = self.page_hashes(seq)
        for i, page in enumerate(match.pages):
            if self.page_hash[page] is None or self.page_hash[page] != keys[i]:
                raise PageAccountingError(f"sequence {seq.seq_id}: page {page} does not "
                                          f"cache prefix page {i}")
        for page in match.pages:
            if self.ref_count[page] == 0:
                del self._evictable[page]
            self.ref_count[page] += 1
            seq.block_table.append(page)
        seq.num_registered_pages = len(match.pages)
        self.prefix_query_tokens += seq.num_tokens
        self.prefix_hit_tokens += match.num_tokens

    def register_computed_pages(self, seq: Sequence) -> int:
        """Register ``seq``'s pages that are now full and computed (call after its
        ``num_computed_tokens`` advanced). A page whose key is already cached elsewhere (the
        same prefix computed twice at once) stays private. Returns pages newly registered."""
        if not self.enable_prefix_caching:
            return 0
        n_full = min(seq.num_computed_tokens // self.page_size, len(seq.block_table))
        added = 0
        if n_full > seq.num_registered_pages:
            keys = self.page_hashes(seq)
            for i in range(seq.num_registered_pages, n_full):
                page = seq.block_table[i]
                if keys[i] not in self._cached and self.page_hash[page] is None:
                    self._cached[keys[i]] = page
                    self.page_hash[page] = keys[i]
                    added += 1
            seq.num_registered_pages = n_full
        return added

    def reset_prefix_cache(self) -> None:
        """Forget every evictable cached page (pages in use keep their keys)."""
        for page in self._evictable:
            del self._cached[self.page_hash[page]]  # type: ignore[arg-type]
            self.page_hash[page] = None
            self._free.append(page)
        self._evictable.clear()

    @property
    def prefix_hit_rate(self) -> float:
        """Prompt tokens served from the cache / prompt tokens looked up (0 before any)."""
        return self.prefix_hit_tokens / max(1, self.prefix_query_tokens)
