"""Persistent per-slot host rows of the running sequences, and a vectorized decode step.

``batch.build_step`` builds any step row by row from the sequences' Python lists: every step
it converts each block table and writes eleven sampling fields per row, about 40 µs of host
time per sequence at batch 256 (CPU). A decode step needs little of that, as vLLM v1's
``InputBatch`` exploits: a sequence's block table only grows while it runs, and its sampling
parameters never change. :class:`InputBatch` keeps, per penalty-state slot (``SlotTable``),
a row of block-table pages and a row of the constant sampling fields, written when a
sequence takes the slot and then only as its table grows (a page every ``page_size`` steps);
a decode step gathers those rows by slot and computes tokens, positions and slots for all
rows at once. The result equals ``build_step``'s exactly (tests/core/test_input_batch.py);
a step it cannot build that way (a prefill, a chunk without a slot, ...) is left to
``build_step``. Plain numpy; no JAX.

A row is valid for one tenure of its slot: ``SlotTable.generation`` counts hand-outs, so a
slot released (finish, abort, preemption: the only times a block table is cleared) and
handed out again, even to the same sequence, is rewritten from scratch.
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Sequence as Seq
from typing import Any

import numpy as np

from jaxinfer.batch import Bucket, SamplingArrays, SlotTable, StepInputs, _fill_row, pick
from jaxinfer.scheduler_types import ScheduledChunk


class InputBatch:
    """Host rows of the sequences holding a slot of ``slots``; builds decode steps from them.

    Args:
      slots: the engine's slot table (rows are indexed by slot).
      page_size: tokens per KV page.
      max_pages: block-table width kept per row (the largest page bucket); a step whose
        sequences need more pages goes to ``build_step``.
    """

    def __init__(self, slots: SlotTable, *, page_size: int, max_pages: int) -> None:
        n = slots.num_slots
        self.slots, self.page_size, self.max_pages = slots, page_size, max_pages
        # Row n is the padding row: null pages, neutral sampling fields, slot -1.
        self._pages = np.zeros((n + 1, max_pages), np.int32)
        self._sampling = SamplingArrays.neutral(n + 1)
        self._num_pages = [0] * n  # leading block-table pages written into the row
        self._owner: list[Any] = [None] * n  # the sequence the row was written for ...
        self._generation = [0] * n  # ... and in which tenure of the slot

    def build_decode(self, chunks: Seq[Any], *, seq_buckets: Seq[int],
                     page_buckets: Seq[int], request_seeds: Mapping[int, int],
                     token_on_device: int = 0, lookahead: int = 0) -> StepInputs | None:
        """The decode step of ``chunks``, equal to ``build_step(chunks, is_prefill=False,
        token_buckets=seq_buckets, slots=slots.mapping, ...)``; None when this path does not
        apply (then call ``build_step``, which also raises what that step raises): a chunk
        that is not a one-token sampling ``ScheduledChunk`` of a sequence holding a slot,
        a block table too short for the chunk, or more rows or pages than the buckets hold.

        ``token_on_device`` n > 0 (async scheduling; True counts as 1): a chunk may feed a
        token up to n past the sequence's known tokens (sampled by the step, or n-step window,
        still in flight); its ``token_ids`` row is then 0, to be replaced on the device
        (``ModelRunner.gather_tokens``).
        ``lookahead`` (multi-step decode): the block tables also hold, and the page bucket
        covers, each row's pages of the ``lookahead`` tokens after its fed one (None when a
        row's table lacks them).
        """
        if not chunks or len(chunks) > seq_buckets[-1]:
            return None
        slot_of, tenure = self.slots.mapping, self.slots.generation
        ps, width = self.page_size, self.max_pages
        owner, generation, num_pages = self._owner, self._generation, self._num_pages
        fields: list[int] = []  # per row: slot, start, token, sample index
        for c in chunks:  # few calls per row: this loop runs per sequence per step
            if type(c) is not ScheduledChunk or c.num_tokens != 1 or not c.samples:
                return None
            seq = c.seq
            key = (seq.seq_id, seq.sample_index)
            if key not in slot_of:
                return None
            s = slot_of[key]
            start, prompt, table = c.start, seq.prompt_token_ids, seq.block_table
            n_prompt, n = len(prompt), len(table)
            if start < n_prompt:
                tok = prompt[start]
            elif start - n_prompt < len(seq.output_token_ids):
                tok = seq.output_token_ids[start - n_prompt]
            elif start - n_prompt < len(seq.output_token_ids) + token_on_device:
                tok = 0
            else:
                return None
            if (start + lookahead) // ps >= (n if n < width else width):  # no page for it
                return None
            if owner[s] is not seq or generation[s] != tenure[s] or n < num_pages[s]:
                self._claim(s, seq, request_seeds.get(seq.seq_id, 0) + seq.sample_index,
                            tenure[s])
            known = num_pages[s]
            if n > known and known < width:
                new = table[known:width]
                self._pages[s, known:known + len(new)] = new
                num_pages[s] = known + len(new)
            fields += (s, start, tok, start + 1 - n_prompt)
        rows, starts, tokens, sample_index = np.array(fields, np.int64).reshape(-1, 4).T
        return self._gather(rows, starts, tokens, sample_index, seq_buckets, page_buckets,
                            lookahead)

    def _claim(self, s: int, seq: Any, seed: int, tenure: int) -> None:
        """Rewrite row ``s`` for ``seq``: no pages yet, its constant sampling fields."""
        self._owner[s], self._generation[s], self._num_pages[s] = seq, tenure, 0
        self._pages[s] = 0
        _fill_row(self._sampling, s, seq, seq.num_prompt_tokens, seed, s)

    def _gather(self, rows: np.ndarray, starts: np.ndarray, tokens: np.ndarray,
                sample_index: np.ndarray, seq_buckets: Seq[int], page_buckets: Seq[int],
                lookahead: int = 0) -> StepInputs:
        """The step's arrays from rows ``rows`` (slots) and per-row values, each [B] int64."""
        B, ps = len(rows), self.page_size
        S = pick(seq_buckets, B, "sequence count")
        start = starts.astype(np.int32)
        need = (start + lookahead) // ps + 1  # pages holding tokens [0, start + lookahead]
        P = pick(page_buckets, int(need.max()), "pages per sequence")
        padded = np.full(S, len(self._owner), np.intp)  # the padding row
        padded[:B] = rows
        block_tables = self._pages[padded, :P]
        if P > 1:  # a row may hold pages past the step's tokens: build_step leaves them 0
            block_tables[:B][np.arange(P) >= need[:, None]] = 0
        token_ids = np.zeros(S, np.int32)
        positions = np.zeros(S, np.int32)
        slot_mapping = np.zeros(S, np.int32)
        seq_ids = np.full(S, -1, np.int32)
        seq_lens = np.zeros(S, np.int32)
        logits_indices = np.zeros(S, np.int32)
        token_ids[:B] = tokens
        positions[:B] = start
        slot_mapping[:B] = block_tables[np.arange(B), start // ps] * ps + start % ps
        seq_ids[:B] = logits_indices[:B] = np.arange(B, dtype=np.int32)
        seq_lens[:B] = start + 1
        sa = SamplingArrays(*(a[padded] for a in self._sampling))
        sa.sample_index[:B] = sample_index
        return StepInputs(Bucket("decode", S, S, P), token_ids, positions, slot_mapping,
                          seq_ids, block_tables, seq_lens, logits_indices, sa)
