"""Continuous-batching scheduler, FCFS (after nano-vllm's ``Scheduler``, with vLLM's chunked
prefill, recompute preemption and automatic prefix caching). Plain Python; no JAX.

Each call to ``schedule()`` plans one step, and a step is EITHER a prefill step OR a decode
step. Mixed steps (vLLM v1 packs decodes and prefill chunks into one token budget) are not
possible here: prefill and decode are separate compiled programs (token buckets vs batch
buckets), so the policy chooses which of the two runs next:

1. Prefill, unless the alternation rule below asks for a decode step (planned by
   ``prefill_plan.plan_prefill``): (a) sequences already running but only partly prefilled
   continue their chunks, oldest first; then (b) waiting sequences are admitted in arrival
   order, stopping at the first that does not fit (no skipping ahead), within
   ``max_num_batched_tokens``, ``max_prefill_seqs`` and ``max_num_seqs``. With chunked prefill
   a prompt longer than the token budget left is cut to fit and continues next step; without
   it a prompt is scheduled whole or not at all. A waiting sequence is admitted only when the
   pages for its whole prompt are free now (beyond the pages still owed to earlier partial
   prefills), though pages are allocated chunk by chunk as tokens are scheduled.
   Prefix caching (``enable_prefix_caching``): at admission the sequence takes the longest
   run of cached full pages that starts its tokens (at most ``num_tokens - 1`` tokens, see
   ``block_manager``), ``num_computed_tokens`` starts there and its first chunk starts after
   the cached prefix; cached tokens cost no budget. After every step the pages that became
   full and computed are registered for later requests.
2. Decode: every running sequence whose K/V lacks only its last token feeds that token (one
   token each, so the budget counts one per sequence). When one needs a new page and none is
   free, the newest running sequence (last admitted) is preempted: its pages are released,
   ``num_computed_tokens`` = 0, and it goes back to the front of ``waiting`` (ordered by
   arrival among the preempted). It keeps its output tokens: its next prefill recomputes
   ``all_token_ids`` (prompt + outputs), so no request is lost; with prefix caching its
   released full pages usually are still cached and are not recomputed.
3. Alternation rule (``max_consecutive_prefills``, default 1): when some running sequence is
   decoding and the last ``max_consecutive_prefills`` steps were prefill steps, the next step
   is a decode step (prefill only if no decode can be scheduled). So running streams get a
   token at least every ``max_consecutive_prefills + 1`` steps while a long prompt is prefilled
   chunk by chunk or new requests keep arriving: their inter-token latency is bounded by
   about k prefill chunks + one decode step, at the cost of the new prompt's time to first
   token (one decode step per chunk). ``None`` restores v1's prefill-first policy, under which
   decodes stall for the whole prefill of a long prompt.
4. If neither is possible (all running sequences are mid-prefill and no page is free for any
   of them), the newest running sequence is preempted and 1-2 are retried. ``add()`` rejects
   requests that could not fit the pool alone, so this always ends with work to do.

Requests with ``n > 1`` samples (:class:`~jaxinfer.sequence.SequenceGroup`): sample 0 is
admitted like any request but prefills its prompt only up to the last token, with room (pages,
``max_num_seqs`` places) held for all n samples. Its first decode step forks samples 1..n-1
(``BlockManager.fork``: full prompt pages shared, a partial last page copied into a fresh page
per new sample; the copies ride in ``SchedulerOutput.page_copies``) and all n feed the last
prompt token in that step, each sampling its own first token. From then on each sample is an
ordinary running sequence: it is preempted on its own (recomputing prompt + its own outputs,
its prompt pages usually found in the prefix cache, held by its siblings) and finishes on its
own; the request finishes when all samples have.

A sequence whose last prompt chunk would be a single token finishes it in a decode step (it is
then decode-shaped). New requests join at step boundaries (``add``); past ``max_queue_len``
waiting requests ``add`` raises ``QueueFullError``. Finished and aborted sequences release
their pages at once. ``postprocess`` advances ``num_computed_tokens``, appends sampled tokens
and applies vLLM's stop rules (EOS unless ``ignore_eos``, ``stop_token_ids``, both only once
``min_tokens`` outputs exist; ``max_tokens`` and ``max_model_len`` give "length"). Stop
strings are matched by the engine on the text, which then calls ``finish(seq_id, "stop")``.
"""

from __future__ import annotations

import itertools
from collections import deque
from typing import TYPE_CHECKING

from jaxinfer.block_manager import BlockManager, PageCopy
from jaxinfer.prefill_plan import places, plan_prefill
from jaxinfer.scheduler_types import (
    DuplicateRequestError,
    QueueFullError,
    RequestTooLongError,
    ScheduledChunk,
    SchedulerConfig,
    SchedulerOutput,
    SequenceStateError,
    StepResult,
    TooManySamplesError,
)
from jaxinfer.sequence import Sequence, SequenceGroup, SequenceStatus

if TYPE_CHECKING:
    from collections.abc import Sequence as Seq


class Scheduler:
    """Decides which sequences run each step and owns the page allocator.

    Usage per step: ``out = schedule()``; run the model on ``out.chunks``; ``postprocess(out,
    sampled)``. Policy in the module docstring. Source: nano-vllm's scheduler (prefill first,
    preempt the newest), vLLM's chunked prefill, recompute preemption and stop rules.
    """

    def __init__(self, cfg: SchedulerConfig) -> None:
        self.cfg = cfg
        self.block_manager = BlockManager(cfg.num_pages, cfg.page_size,
                                          enable_prefix_caching=cfg.enable_prefix_caching)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order (forked samples after sample 0)
        self._groups: dict[int, SequenceGroup] = {}  # unfinished requests by id
        self._rank: dict[int, int] = {}  # seq_id -> arrival rank (FCFS order of add())
        self._forks: list[tuple[Sequence, PageCopy]] = []  # this plan's copy-on-write copies
        self._counter = itertools.count()
        self._eos = frozenset(cfg.eos_token_ids)
        self._prefills_in_a_row = 0  # consecutive prefill steps (alternation rule)
        # Recompute preemptions since start (vLLM's ``num_preemptions_total``): a pool too
        # small for the running set shows here, and each one re-runs that sequence's prefill.
        self.num_preemptions_total = 0

    # ---------------------------------------------------------------- requests in and out
    def add(self, seq: Sequence) -> None:
        """Queue a new sequence (it joins at the next step).

        Raises:
          DuplicateRequestError: seq_id already waiting or running.
          SequenceStateError: seq is not fresh (status, pages, outputs or computed tokens).
          RequestTooLongError: prompt + max_tokens > max_model_len, or its KV (prompt +
            max_tokens - 1 tokens: the last sampled token is never fed; with n samples the
            full prompt pages once and the rest n times) > the whole pool.
          TooManySamplesError: ``n`` > max_num_seqs.
          QueueFullError: ``max_queue_len`` requests are already waiting.
        """
        if seq.seq_id in self._groups:
            raise DuplicateRequestError(f"request {seq.seq_id} is already scheduled")
        if (seq.status is not SequenceStatus.WAITING or seq.block_table or seq.output_token_ids
                or seq.num_computed_tokens or seq.sample_index or len(seq.group.samples) > 1):
            raise SequenceStateError(f"add(): request {seq.seq_id} is not a fresh sequence: "
                                     f"{seq!r}")
        cfg, p, m = self.cfg, seq.num_prompt_tokens, seq.sampling_params.max_tokens
        if p + m > cfg.max_model_len:
            raise RequestTooLongError(
                f"request {seq.seq_id}: prompt ({p} tokens) + max_tokens ({m}) = {p + m} "
                f"exceeds max_model_len ({cfg.max_model_len})")
        k = seq.sampling_params.n
        if k > cfg.max_num_seqs:
            raise TooManySamplesError(f"request {seq.seq_id}: n = {k} samples, but at most "
                                      f"max_num_seqs = {cfg.max_num_seqs} sequences run at once")
        shared = (p - 1) // cfg.page_size if k > 1 else 0  # full pages before the fork
        pages = shared + k * (self.block_manager.pages_for_tokens(p + m - 1) - shared)
        if pages > self.block_manager.num_usable_pages:
            samples = f" x n = {k} samples" if k > 1 else ""
            raise RequestTooLongError(
                f"request {seq.seq_id}: prompt ({p} tokens) + max_tokens ({m}){samples} needs "
                f"{pages} KV pages of {cfg.page_size} tokens, the pool has "
                f"{self.block_manager.num_usable_pages}")
        if cfg.max_queue_len is not None and (q := self._queued()) >= cfg.max_queue_len:
            raise QueueFullError(f"request {seq.seq_id}: {q} requests waiting for a place, "
                                 f"max_queue_len is {cfg.max_queue_len}")
        self._groups[seq.seq_id] = seq.group
        self._rank[seq.seq_id] = next(self._counter)
        self.waiting.append(seq)

    def abort(self, seq_id: int) -> Sequence | None:
        """Finish every unfinished sample of a request with reason "abort", freeing their
        pages at once. Returns sample 0, or None if no unfinished request has that id."""
        return self.finish(seq_id, "abort")

    def finish(self, seq_id: int, reason: str) -> Sequence | None:
        """Finish every unfinished sample of a request with ``reason`` ("stop", "length",
        "abort"), freeing their pages at once. Returns sample 0, or None if no unfinished
        request has that id. Raises ValueError for another reason."""
        _check_reason(reason)
        group = self._groups.get(seq_id)
        if group is None:
            return None
        for seq in list(group.samples):
            if not seq.is_finished:
                self._finish(seq, reason)
        return group.samples[0]

    def finish_sample(self, seq: Sequence, reason: str) -> None:
        """Finish one sample ("stop" when the engine finds a stop string in its text),
        freeing its pages at once; nothing happens if it already finished. Raises ValueError
        for an unknown reason, SequenceStateError for a sequence this scheduler does not
        hold."""
        _check_reason(reason)
        if seq.is_finished:
            return
        if self._groups.get(seq.seq_id) is not seq.group:
            raise SequenceStateError(f"finish_sample: {seq!r} is not scheduled here")
        self._finish(seq, reason)

    def get(self, seq_id: int) -> Sequence | None:
        """An unfinished (waiting or running) sample of this request, a running one if
        there is one, or None when the request is not here or has finished."""
        group = self._groups.get(seq_id)
        if group is None:
            return None
        live = [s for s in group.samples if not s.is_finished]
        return next((s for s in live if s.status is SequenceStatus.RUNNING), live[0])

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def _queued(self) -> int:
        """Waiting requests beyond those the free places of ``max_num_seqs`` take in order
        (what ``max_queue_len`` bounds: with 2 places free, 2 requests added between steps
        are admitted by the next one, so they are not queued; KV pages are not counted)."""
        free = self.cfg.max_num_seqs - sum(places(s) for s in self.running)
        for i, seq in enumerate(self.waiting):
            free -= seq.group.n
            if free < 0:
                return len(self.waiting) - i
        return 0

    @property
    def num_running(self) -> int:
        return len(self.running)

    # ---------------------------------------------------------------- planning a step
    def schedule(self) -> SchedulerOutput:
        """Plan the next step and allocate its pages (see the module docstring).

        Returns an empty decode output only when nothing is waiting or running.
        """
        preempted: list[Sequence] = []
        self._forks = []
        while True:
            out = self._schedule_once(preempted)
            if out is not None:
                self._prefills_in_a_row = self._prefills_in_a_row + 1 if out.is_prefill else 0
                # Copies into samples preempted again in this plan are dropped.
                out.page_copies = [c for q, c in self._forks
                                   if q.status is SequenceStatus.RUNNING]
                return out
            if not self.running:  # guarded against by add(); never loop forever
                raise RuntimeError(f"scheduler cannot admit {self.waiting[0]!r} into an empty "
                                   f"pool of {self.block_manager.num_free_pages} pages")
            # Every running sequence is mid-prefill with no free page: make room.
            self._preempt(self.running[-1], preempted)

    def _schedule_once(self, preempted: list[Sequence]) -> SchedulerOutput | None:
        """One attempt at a plan; None when no work fits (caller preempts and retries)."""
        k = self.cfg.max_consecutive_prefills
        if k is not None and self._prefills_in_a_row >= k:  # alternation: decodes first
            chunks = self._schedule_decode(preempted)
            if chunks:
                return SchedulerOutput(False, chunks, preempted)
        chunks = plan_prefill(self.cfg, self.block_manager, self.running, self.waiting,
                              preempted)
        if chunks:
            return SchedulerOutput(True, chunks, preempted)
        chunks = self._schedule_decode(preempted)
        if chunks or not self.has_unfinished:
            return SchedulerOutput(False, chunks, preempted)
        return None

    def _schedule_decode(self, preempted: list[Sequence]) -> list[ScheduledChunk]:
        bm = self.block_manager
        chunks: list[ScheduledChunk] = []
        i = 0
        # By index: a fork inserts its new samples right after sample 0, and they decode
        # in this step too; preemption only removes running[-1], never one before i.
        while i < len(self.running):
            seq = self.running[i]
            i += 1
            n = seq.num_tokens
            if n - seq.num_computed_tokens != 1:
                continue  # mid-prefill
            if seq.fork_pending and not self._fork(seq, preempted):
                continue  # preempted while making room for the fork
            if bm.has_room(seq, 1):  # its pages hold the fed token: none needed
                chunks.append(ScheduledChunk(seq, n - 1, 1))
                continue
            while not bm.can_allocate(seq, 1):
                # running[-1] is never a sequence scheduled in this loop: those come before seq.
                victim = self.running[-1]
                self._preempt(victim, preempted)
                if victim is seq:
                    break
            else:
                bm.allocate(seq, 1)
                chunks.append(ScheduledChunk(seq, seq.num_tokens - 1, 1))
        return chunks

    def _fork(self, seq: Sequence, preempted: list[Sequence]) -> bool:
        """Fork samples 1..n-1 of ``seq`` (sample 0, its prompt computed up to the last
        token) into ``running`` right after it, sharing its pages; a partial last page is
        copied into a fresh page per sample (preempting the newest running sequences when
        too few are free). Returns False if ``seq`` itself was preempted (nothing forked)."""
        bm, k = self.block_manager, seq.group.n
        need = k - 1 if seq.num_computed_tokens % bm.page_size else 0
        while bm.num_free_pages < need:
            victim = self.running[-1]
            self._preempt(victim, preempted)
            if victim is seq:
                return False
        at = self.running.index(seq) + 1
        for index in range(1, k):
            child = seq.fork(index)
            copy = bm.fork(seq, child)
            if copy is not None:
                self._forks.append((child, copy))
            child.status = SequenceStatus.RUNNING
            self.running.insert(at + index - 1, child)
        seq.fork_pending = False
        return True

    def _preempt(self, seq: Sequence, preempted: list[Sequence]) -> None:
        """Recompute preemption: free the pages, requeue at the front of waiting (among
        other preempted sequences, by arrival)."""
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions_total += 1
        rank, i = self._rank[seq.seq_id], 0
        while i < len(self.waiting) and self._rank[self.waiting[i].seq_id] < rank:
            i += 1
        self.waiting.insert(i, seq)
        preempted.append(seq)

    # ---------------------------------------------------------------- after the step
    def postprocess(self, out: SchedulerOutput, sampled: Seq[int]) -> StepResult:
        """Record a finished step.

        Args:
          out: the plan returned by the last ``schedule()``.
          sampled: one token id per chunk of ``out`` (used only where ``chunk.samples``).
        Returns:
          StepResult(new_tokens, finished); finished sequences' pages are already free.
          Sequences aborted since ``schedule()`` are skipped.
        Raises:
          ValueError: ``len(sampled) != len(out.chunks)``.
          SequenceStateError: a chunk does not start at its sequence's computed tokens
            (e.g. the same output postprocessed twice).
        """
        if len(sampled) != len(out.chunks):
            raise ValueError(f"postprocess: {len(sampled)} sampled tokens for "
                             f"{len(out.chunks)} scheduled chunks")
        new_tokens: list[tuple[Sequence, int]] = []
        finished: list[Sequence] = []
        bm = self.block_manager
        for chunk, tok in zip(out.chunks, sampled):
            seq = chunk.seq
            status = seq.status
            if status is SequenceStatus.FINISHED:
                continue
            if status is not SequenceStatus.RUNNING or chunk.start != seq.num_computed_tokens:
                raise SequenceStateError(
                    f"postprocess: chunk of request {seq.seq_id} starts at {chunk.start} but "
                    f"{seq!r}; was this output already postprocessed?")
            seq.num_computed_tokens += chunk.num_tokens
            bm.register_computed_pages(seq)  # pages this step filled (returns at once if none)
            if not chunk.samples:
                continue
            tok = int(tok)
            new_tokens.append((seq, tok))
            if self._append(seq, tok):
                finished.append(seq)
        return StepResult(new_tokens, finished)

    def append_token(self, seq: Sequence, tok: int) -> bool:
        """Append ``tok`` to running ``seq``'s outputs without a step (a token its
        structured-outputs grammar forces: jump-forward decoding) under the stop rules of a
        sampled token (``postprocess`` appends those the same way); its K/V is computed by
        the next prefill step, which feeds it with the sequence's other uncomputed tokens
        and samples the token after them. Returns True when the token finished the
        sequence (its pages are free).

        Raises:
          SequenceStateError: ``seq`` is not running.
        """
        if seq.status is not SequenceStatus.RUNNING:
            raise SequenceStateError(f"append_token: {seq!r} is not running")
        return self._append(seq, int(tok))

    def _append(self, seq: Sequence, tok: int) -> bool:
        """Append ``tok`` (an int) to running ``seq``'s outputs under the stop rules;
        True when it finished the sequence."""
        seq.output_token_ids.append(tok)
        reason = self._stop_reason(seq, tok)
        if reason is not None:
            self._finish(seq, reason)
            return True
        return False

    def _stop_reason(self, seq: Sequence, tok: int) -> str | None:
        sp, n_out = seq.sampling_params, seq.num_output_tokens
        if n_out >= sp.min_tokens and (
                (not sp.ignore_eos and tok in self._eos) or tok in sp.stop_token_ids):
            return "stop"
        if n_out >= sp.max_tokens or seq.num_tokens >= self.cfg.max_model_len:
            return "length"
        return None

    def _finish(self, seq: Sequence, reason: str) -> None:
        if seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        else:
            self.running.remove(seq)
            self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        if seq.group.is_finished:
            del self._groups[seq.seq_id]
            del self._rank[seq.seq_id]


def _check_reason(reason: str) -> None:
    if reason not in ("stop", "length", "abort"):
        raise ValueError(f"finish reason must be 'stop', 'length' or 'abort', got {reason!r}")
