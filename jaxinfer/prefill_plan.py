"""The prefill half of a scheduler step: which prompt chunks run, and the admission of
waiting sequences. Split out of ``scheduler.py``, whose docstring (point 1) gives the policy;
plain Python, no JAX.

Page accounting of an admission: a waiting sequence is admitted only when the pages for its
whole prompt, plus one per sample still to fork, are free now beyond the pages owed to the
running sequences' unfinished prompts (``pages_owed``); an unforked ``n > 1`` request holds n
of the ``max_num_seqs`` places (``places``).
"""

from __future__ import annotations

from collections import deque

from jaxinfer.block_manager import NO_MATCH, BlockManager
from jaxinfer.scheduler_types import ScheduledChunk, SchedulerConfig
from jaxinfer.sequence import Sequence, SequenceStatus


def places(seq: Sequence) -> int:
    """Places among max_num_seqs that ``seq`` holds: all n samples before its fork."""
    return seq.group.n if seq.fork_pending else 1


def pages_owed(bm: BlockManager, seq: Sequence) -> int:
    """Pages ``seq`` still needs until all its samples hold their prompt: the rest of
    its prompt, and a page per sample still to fork (its copy of a partial last page,
    or its page for the last prompt token)."""
    return (bm.pages_needed(seq, seq.num_tokens - seq.num_computed_tokens)
            + (seq.group.n - 1 if seq.fork_pending else 0))


def plan_prefill(cfg: SchedulerConfig, bm: BlockManager, running: list[Sequence],
                 waiting: deque[Sequence], preempted: list[Sequence]) -> list[ScheduledChunk]:
    """The chunks of one prefill step (empty when no prefill work fits).

    Allocates the chunks' pages; admitted sequences move from the front of ``waiting`` to the
    end of ``running`` (status RUNNING, cached prefix taken). A sequence ``preempted`` in this
    plan is not readmitted in it while anything runs.
    """
    budget = cfg.max_num_batched_tokens
    chunks: list[ScheduledChunk] = []
    promised = 0  # pages partial prefills (and their forks) still need
    held = 0  # of max_num_seqs, held by running sequences and their unforked samples
    for seq in running:  # (a) continue partial prefills, oldest first
        pending = seq.fork_pending
        held += places(seq)
        # An unforked sample 0 stops before its last prompt token (its decode forks).
        remaining = seq.num_tokens - seq.num_computed_tokens - pending
        if remaining < 1 or (remaining == 1 and not pending):
            if pending:  # ready to fork: keep its samples' pages
                promised += pages_owed(bm, seq)
            continue  # decoding
        n = 0
        if len(chunks) < cfg.max_prefill_seqs:
            fit = (len(seq.block_table) + bm.num_free_pages) * bm.page_size
            n = min(remaining, budget, fit - seq.num_computed_tokens)
        if n > 0:
            bm.allocate(seq, n)
            chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, n))
            budget -= n
        promised += pages_owed(bm, seq)
    while (waiting and budget > 0 and len(chunks) < cfg.max_prefill_seqs
           and held < cfg.max_num_seqs):  # (b) admit, FCFS
        seq = waiting[0]
        if running and any(seq is p for p in preempted):
            break  # not back in the step that preempted it
        if held + places(seq) > cfg.max_num_seqs:
            break
        match = bm.match_prefix(seq) if cfg.enable_prefix_caching else NO_MATCH
        # The cached prefix costs no budget; an unforked sample 0 stops before its
        # last prompt token (it may then have nothing to prefill: its decode forks).
        n = seq.num_tokens - match.num_tokens - seq.fork_pending
        if n > budget:
            if not cfg.enable_chunked_prefill:
                break
            n = budget
        forks = seq.group.n - 1 if seq.fork_pending else 0  # one page per new sample
        if bm.pages_to_admit(seq, match, seq.num_tokens) + forks + promised > bm.num_free_pages:
            break
        waiting.popleft()
        seq.status = SequenceStatus.RUNNING
        running.append(seq)
        held += places(seq)
        bm.take_prefix(seq, match)
        seq.num_computed_tokens = seq.num_cached_tokens = match.num_tokens
        bm.allocate(seq, n)
        if n:
            chunks.append(ScheduledChunk(seq, match.num_tokens, n))
        budget -= n
        promised += pages_owed(bm, seq)
    return chunks
