"""Async scheduling (``EngineConfig.async_scheduling``): the plan of the decode step that is
dispatched while the previous decode step still runs. Plain Python; no JAX.

After vLLM v1's ``--async-scheduling`` (``AsyncScheduler``: output placeholders, the model
runner taking the previous step's sampled token ids on the device) and SGLang's overlap
scheduler. With it, ``LLMEngine.step`` dispatches decode step k+1 before reading step k's
tokens back: step k+1's rows feed step k's sampled tokens, gathered on the device by row
(``ModelRunner.gather_tokens``); the host reads step k's tokens one step late and appends
them, applies the stop rules and streams them as the synchronous engine does.

Which steps pipeline: a decode step k+1 is planned here from the decode step k in flight, only
when the synchronous scheduler, given what the host knows before reading step k back, would
have planned the same rows, that is when

* step k was a decode step whose chunks hold every running sequence (no sequence is
  mid-prefill, none waits to fork its ``n > 1`` samples);
* nothing is waiting, or the synchronous scheduler could admit none of the waiting sequences
  at step k+1 (it would prefill it first otherwise): no row of step k ends by length (such a
  row frees a place and pages) and the first waiting sequence finds no room, by the same
  tests ``prefill_plan.plan_prefill`` makes (its ``places`` on top of the places the running
  sequences hold exceed ``max_num_seqs``; or, without chunked prefill, its prompt past the
  prefix-cache match exceeds ``max_num_batched_tokens``; or the pages it needs exceed the
  free pages), its prefix match taken over the cached pages plus the pages step k fills
  (registered when step k is read back);
* every row's pages for the new token come from free pages (no preemption): with nothing
  waiting any free page, a cached one evicted least recently released first as the
  synchronous scheduler's next steps would (``pages_ahead``); while a request waits only
  never-cached ones, so that its admission sees the synchronous scheduler's prefix cache;
* the rows fill the same batch bucket as step k (the gather program is keyed by it).

Otherwise the engine reads step k back and schedules synchronously. Rows of step k that must
end by length (``max_tokens``, ``max_model_len``) are left out of step k+1, as the
synchronous scheduler leaves them out; a row whose token at step k turns out to stop it (EOS,
a stop token or string) runs one wasted row in step k+1: its token is discarded (the
scheduler skips finished sequences), the page allocated ahead for it is freed with the
sequence, and its penalty-count row is rewritten before another sequence with penalties or
``min_tokens`` uses the slot (``runner.load_history``). A sequence finished or aborted while
step k+1 runs is simply left out of the step after it.

The one place the schedule differs from the synchronous engine's: when requests wait and a
row stops at step k by EOS, a stop token or a stop string (or a request is aborted between
the steps), the synchronous engine fills the place and pages it frees at step k+1 with a
prefill; the async engine learns of the stop only when it reads step k back, after step
k+1 is dispatched, so it admits the waiting request one step later (as vLLM's async
scheduler does). Every request's tokens and finish reasons stay the same (sampling keys are
per request and token; a greedy token does not depend on the step), only the step at which a
waiting request is admitted, and so the order of steps, can move; a request then shares its
steps with other requests than it would have, so its logprobs can differ in the last float32
bits (other batch buckets round differently), as they do in the synchronous engine when
requests arrive at other times. With nothing waiting the steps
are the synchronous engine's, one for one. Offline runs with more requests than
``max_num_seqs`` places keep a waiting queue for most of the run: without this, no step of
theirs would pipeline.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from jaxinfer.batch import pick
from jaxinfer.prefill_plan import places
from jaxinfer.scheduler import Scheduler
from jaxinfer.scheduler_types import ScheduledChunk, SchedulerOutput
from jaxinfer.sequence import SequenceStatus


class NextDecode(NamedTuple):
    """A pipelined decode step (or multi-step window).

    Attributes:
      out: its plan (one chunk per row, feeding the token the step in flight samples; of a
        window: the first of ``steps``).
      rows: [S] int32, for each row of the new step the row of the step in flight whose
        sampled token it feeds (padding rows 0); S is both steps' batch bucket.
      steps: the window's ``window`` one-step plans (multi_step.plan_multi_step's form);
        ``[out]`` for one step.
    """

    out: SchedulerOutput
    rows: np.ndarray
    steps: list[SchedulerOutput]


def plan_next_decode(scheduler: Scheduler, prev: SchedulerOutput, prev_rows: int,
                     decode_buckets: tuple[int, ...], max_model_len: int,
                     window: int = 1) -> NextDecode | None:
    """Plan decode step k+1 from ``prev``, the decode step k in flight (its tokens not yet
    appended), allocating the rows' pages; None when the step must not pipeline (see the
    module docstring; nothing is allocated then).

    ``window`` w > 1 (multi-step decode, multi_step.py): ``prev`` is the first step of a
    w-step window in flight and the plan is the next window's w steps, feeding the token the
    window's last step samples. It pipelines under the same conditions, except that nothing
    may wait (admission is not predicted over a window), and only when the one-step engine
    would run the next window as a window too (``plan_multi_step``: every kept row's
    positions stay inside ``max_model_len``); rows that end by length inside the window in
    flight are left out.

    Args:
      scheduler: the engine's scheduler (state after step k-1's ``postprocess``).
      prev: step k's plan.  prev_rows: step k's batch bucket S.
      decode_buckets: the engine's decode batch buckets.  max_model_len: the engine's.
      window: decode steps per program (1: one-step async scheduling).
    """
    w = window
    if prev.is_prefill or not prev.chunks or (w > 1 and scheduler.waiting):
        return None
    live: list[tuple[int, ScheduledChunk]] = []
    for i, c in enumerate(prev.chunks):
        seq = c.seq
        if seq.status is SequenceStatus.FINISHED:  # stopped or aborted since: drop the row
            continue
        if (seq.status is not SequenceStatus.RUNNING or c.num_tokens != 1 or not c.samples
                or seq.fork_pending or c.start != seq.num_computed_tokens
                or c.start + 1 != seq.num_tokens
                or seq.sampling_params.structured_outputs is not None):  # mask from step k
            return None
        live.append((i, c))
    if len(live) != len(scheduler.running):  # a running sequence outside step k
        return None
    keep = []
    for i, c in live:
        seq, sp = c.seq, c.seq.sampling_params
        # After step k (a window: its w steps): num_output_tokens + w outputs, num_tokens + w
        # tokens.
        if seq.num_output_tokens + w >= sp.max_tokens or seq.num_tokens + w >= max_model_len:
            continue  # ends by length at step k: the synchronous scheduler drops it too
        if seq.num_tokens + 2 * w - 1 > max_model_len:  # positions fed < max_model_len
            return None  # the next window would run as one step
        keep.append((i, c))
    if not keep or len(keep) > decode_buckets[-1]:
        return None
    if scheduler.waiting and (len(keep) != len(live)
                              or not admission_blocked(scheduler, [c for _, c in live])):
        return None  # the synchronous scheduler would (or might) admit at step k+1
    if pick(decode_buckets, len(keep), "sequence count") != prev_rows:
        return None
    bm = scheduler.block_manager
    need = sum(bm.pages_needed(c.seq, 2 * w) for _, c in keep)  # tokens start .. + 2w - 1
    if need > pages_ahead(scheduler):
        return None
    for _, c in keep:
        bm.allocate(c.seq, 2 * w)
    steps = []
    for j in range(w):
        chunks = []
        for _, c in keep:
            nxt = ScheduledChunk(c.seq, c.start + w + j, 1)
            nxt._samples = True  # it ends at the token step k (the step before) samples
            chunks.append(nxt)
        steps.append(SchedulerOutput(False, chunks))
    rows = np.zeros(prev_rows, np.int32)
    rows[:len(keep)] = [i for i, _ in keep]
    return NextDecode(steps[0], rows, steps)


def pages_ahead(scheduler: Scheduler) -> int:
    """Free pages a plan made ahead of the synchronous scheduler (a pipelined step or window,
    a multi-step window) may allocate. With nothing waiting, all of them: cached ones are
    evicted least recently released first, as the synchronous scheduler's next steps would
    evict them (a row that then stops early may leave evicted a page the synchronous engine
    would still hold: a later request's prefix match can be shorter, which changes the work,
    not the tokens). While a request waits, only never-cached pages, so that its admission
    (``admission_blocked``) sees the prefix cache the synchronous scheduler would.

    Before session 28 it was never-cached pages always: once a server's traffic had cycled
    the pool, every free page was cached and no step or window pipelined again."""
    bm = scheduler.block_manager
    return bm.num_free_pages - (bm.num_evictable_pages if scheduler.waiting else 0)


def admission_blocked(scheduler: Scheduler, rows: list[ScheduledChunk]) -> bool:
    """Whether the synchronous scheduler, planning the step after decode step ``rows`` (in
    flight; every running sequence has a row, none ends by length, none is mid-prefill or
    waits to fork), would admit no waiting sequence, provided no row stops at that step.

    The tests of ``prefill_plan.plan_prefill`` for the first waiting sequence, on the state
    it would see then: the running sequences hold the same places and pages (none finished,
    none mid-prefill, so none is owed pages); the prefix cache holds, besides its pages now,
    the pages that ``rows`` fill (registered when the step is read back; a page
    whose key is already cached is not registered again, which leaves the set of cached
    keys the same). Its budget and ``max_prefill_seqs`` are untouched (no partial prefill
    runs), and a sequence preempted in that plan is none of these (nothing is preempted
    before admission).
    """
    cfg, bm = scheduler.cfg, scheduler.block_manager
    head = scheduler.waiting[0]
    held = sum(places(s) for s in scheduler.running)
    if held + places(head) > cfg.max_num_seqs:
        return True
    ps = bm.page_size
    filled = ({bm.page_hashes(c.seq)[c.start // ps] for c in rows if (c.start + 1) % ps == 0}
              if cfg.enable_prefix_caching else set())
    match = bm.match_prefix(head, filling=filled)
    if (not cfg.enable_chunked_prefill and head.num_tokens - match.num_tokens
            - head.fork_pending > cfg.max_num_batched_tokens):
        return True
    need = (bm.pages_to_admit(head, match, head.num_tokens)
            + (head.group.n - 1 if head.fork_pending else 0))  # a page per sample to fork
    return need > bm.num_free_pages
