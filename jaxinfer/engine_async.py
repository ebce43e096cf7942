"""Async scheduling (``EngineConfig.async_scheduling``): the plan of the decode step that is
dispatched while the previous decode step still runs. Plain Python; no JAX.

After vLLM v1's ``--async-scheduling`` (``AsyncScheduler``: output placeholders, the model
runner taking the previous step's sampled token ids on the device) and SGLang's overlap
scheduler. With it, ``LLMEngine.step`` dispatches decode step k+1 before reading step k's
tokens back: step k+1's rows feed step k's sampled tokens, gathered on the device by row
(``ModelRunner.gather_tokens``); the host reads step k's tokens one step late and appends
them, applies the stop rules and streams them as the synchronous engine does.

Which steps pipeline: a decode step k+1 is planned here from the decode step k in flight, only
when the synchronous scheduler would have planned the same rows, that is when

* step k was a decode step whose chunks hold every running sequence (no sequence is
  mid-prefill, none waits to fork its ``n > 1`` samples), and nothing is waiting (the
  scheduler would prefill it first);
* every row's pages for the new token come from never-cached free pages (no preemption, no
  eviction of a prefix-cache page that the synchronous engine would have kept);
* the rows fill the same batch bucket as step k (the gather program is keyed by it).

Otherwise the engine reads step k back and schedules synchronously. Rows of step k that must
end by length (``max_tokens``, ``max_model_len``) are left out of step k+1, as the
synchronous scheduler leaves them out; a row whose token at step k turns out to stop it (EOS,
a stop token or string) runs one wasted row in step k+1: its token is discarded (the
scheduler skips finished sequences), the page allocated ahead for it is freed with the
sequence, and its penalty-count row is rewritten before another sequence with penalties uses
the slot (``runner.load_history``). A sequence finished or aborted while step k+1 runs is
simply left out of the step after it.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from jaxinfer.batch import pick
from jaxinfer.scheduler import Scheduler
from jaxinfer.scheduler_types import ScheduledChunk, SchedulerOutput
from jaxinfer.sequence import SequenceStatus


class NextDecode(NamedTuple):
    """A pipelined decode step.

    Attributes:
      out: its plan (one chunk per row, feeding the token the step in flight samples).
      rows: [S] int32, for each row of the new step the row of the step in flight whose
        sampled token it feeds (padding rows 0); S is both steps' batch bucket.
    """

    out: SchedulerOutput
    rows: np.ndarray


def plan_next_decode(scheduler: Scheduler, prev: SchedulerOutput, prev_rows: int,
                     decode_buckets: tuple[int, ...], max_model_len: int) -> NextDecode | None:
    """Plan decode step k+1 from ``prev``, the decode step k in flight (its tokens not yet
    appended), allocating the rows' pages; None when the step must not pipeline (see the
    module docstring; nothing is allocated then).

    Args:
      scheduler: the engine's scheduler (state after step k-1's ``postprocess``).
      prev: step k's plan.  prev_rows: step k's batch bucket S.
      decode_buckets: the engine's decode batch buckets.  max_model_len: the engine's.
    """
    if prev.is_prefill or not prev.chunks or scheduler.waiting:
        return None
    live: list[tuple[int, ScheduledChunk]] = []
    for i, c in enumerate(prev.chunks):
        seq = c.seq
        if seq.status is SequenceStatus.FINISHED:  # stopped or aborted since: drop the row
            continue
        if (seq.status is not SequenceStatus.RUNNING or c.num_tokens != 1 or not c.samples
                or seq.fork_pending or c.start != seq.num_computed_tokens
                or c.start + 1 != seq.num_tokens):
            return None
        live.append((i, c))
    if len(live) != len(scheduler.running):  # a running sequence outside step k
        return None
    keep = []
    for i, c in live:
        seq, sp = c.seq, c.seq.sampling_params
        # After step k: num_output_tokens + 1 outputs, num_tokens + 1 tokens.
        if seq.num_output_tokens + 1 >= sp.max_tokens or seq.num_tokens + 1 >= max_model_len:
            continue  # ends by length at step k: the synchronous scheduler drops it too
        keep.append((i, c))
    if not keep or len(keep) > decode_buckets[-1]:
        return None
    if pick(decode_buckets, len(keep), "sequence count") != prev_rows:
        return None
    bm = scheduler.block_manager
    need = sum(bm.pages_needed(c.seq, 2) for _, c in keep)  # tokens start and start + 1
    if need > bm.num_free_pages - bm.num_evictable_pages:
        return None
    chunks = []
    for _, c in keep:
        bm.allocate(c.seq, 2)
        nxt = ScheduledChunk(c.seq, c.start + 1, 1)
        nxt._samples = True  # it ends at the token step k samples
        chunks.append(nxt)
    rows = np.zeros(prev_rows, np.int32)
    rows[:len(keep)] = [i for i, _ in keep]
    return NextDecode(SchedulerOutput(False, chunks), rows)
