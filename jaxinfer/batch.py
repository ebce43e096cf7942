"""Turn a scheduler decision into padded numpy arrays of a compiled bucket (no JAX here).

A *bucket* is the static shape of one compiled program: ``(kind, T, S, maxp)`` with T the
token count, S the sequence rows and maxp the block-table width in pages. Rows and tokens
past the real ones are padding: their tokens write into the null page 0, their block-table
entries are 0, and their ``seq_lens`` are 0 so attention ignores them.
"""

from __future__ import annotations

import bisect
from collections.abc import Hashable, Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import numpy as np

# Sampling seeds are split into two uint32 words; a request without a seed gets one drawn
# from the engine's generator so that unseeded requests differ from each other. Sample i of
# an n > 1 request draws with the request's seed + i (vLLM v1's parallel sampling does the
# same), so its samples differ and each is reproducible.
_U32 = np.uint32
_I32_MAX = int(np.iinfo(np.int32).max)


class BucketError(ValueError):
    """The step does not fit any compiled bucket (a scheduler/config mismatch)."""


@dataclass(frozen=True)
class Bucket:
    kind: str  # "prefill" | "decode"
    num_tokens: int
    num_seqs: int
    max_pages: int

    def __str__(self) -> str:
        return f"{self.kind}(T={self.num_tokens}, S={self.num_seqs}, pages={self.max_pages})"


def pick(buckets: Seq[int], n: int, what: str) -> int:
    """Smallest bucket >= n; raises BucketError when none holds n."""
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise BucketError(f"{what} {n} exceeds the largest bucket {buckets[-1]}")
    return buckets[i]


class SamplingArrays(NamedTuple):
    """Per-row sampling parameters of one step (numpy on the host, jax arrays on the device).

    Every field is [S] (seeds [S, 2]); padding rows hold neutral values (greedy, no
    penalties, slot -1, no logprobs). See ``sampling.sample_rows`` for how they are used.

    Attributes:
      temperature: float32, 0 = greedy.  top_k: int32, 0 = off.  top_p: float32 in (0, 1].
      min_p: float32 in [0, 1].  repetition_penalty: float32 > 0 (1 = off).
      presence_penalty / frequency_penalty: float32 in [-2, 2] (0 = off).
      seeds: uint32 [S, 2], the sample's 64-bit seed (request seed + sample index) as
        (low, high) words.
      sample_index: int32 index of the output token being sampled (0 = first).
      slots: int32 persistent penalty-state row of the sequence; -1 = none (scratch row).
      want_logprobs: bool, the request asked for logprobs (the step then computes the
        ``MAX_LOGPROBS`` best of every row; the host keeps as many as each request wants).
      min_tokens: int32, the request's ``min_tokens``: while ``sample_index`` is below it,
        the row's stop tokens (flagged in its slot's penalty state) are masked; 0 = off.
      allowed_only: bool, the request has ``allowed_token_ids`` or ``structured_outputs``
        (the allowed tokens flagged in its slot's penalty state): every other token is
        masked.
      has_bias: bool, the request has a ``logit_bias`` or ``bad_words`` (loaded in its
        slot's ``sampling_penalties.LogitBias`` row): the bias is added to the row's logits,
        the bad words' tokens masked.
    All-zero arrays are valid input too (greedy rows, no penalties, slot 0, no logprobs).
    """

    temperature: Any
    top_k: Any
    top_p: Any
    min_p: Any
    repetition_penalty: Any
    presence_penalty: Any
    frequency_penalty: Any
    seeds: Any
    sample_index: Any
    slots: Any
    want_logprobs: Any
    min_tokens: Any
    allowed_only: Any
    has_bias: Any

    @classmethod
    def neutral(cls, S: int) -> SamplingArrays:
        """numpy arrays of ``S`` greedy rows without penalties, slots, logprobs,
        ``min_tokens``, ``allowed_token_ids`` or ``logit_bias``."""
        f32, i32 = np.float32, np.int32
        return cls(np.zeros(S, f32), np.zeros(S, i32), np.ones(S, f32), np.zeros(S, f32),
                   np.ones(S, f32), np.zeros(S, f32), np.zeros(S, f32), np.zeros((S, 2), _U32),
                   np.zeros(S, i32), np.full(S, -1, i32), np.zeros(S, bool), np.zeros(S, i32),
                   np.zeros(S, bool), np.zeros(S, bool))


class SlotError(RuntimeError):
    """No free penalty-state slot (more running sequences than ``max_num_seqs``)."""


class SlotTable:
    """Persistent slots (rows of the device's penalty state) of running sequences.

    The engine assigns a slot when a sequence is admitted (or re-admitted after preemption)
    and releases it when the sequence finishes, is aborted or preempted. Sequences are named
    by ``Sequence.key`` (request id, sample index). Plain Python.

    Args:
      num_slots: how many sequences can hold a slot at once (``max_num_seqs``).
    """

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out 0 first
        self._of: dict[Hashable, int] = {}
        # generation[s]: times slot s was handed out; host state kept per slot (see
        # input_batch.InputBatch) is stale when written for an older generation.
        self.generation = [0] * num_slots

    def get(self, key: Hashable) -> int | None:
        return self._of.get(key)

    def assign(self, key: Hashable) -> int:
        """A free slot for sequence ``key`` (raises SlotError when none is free)."""
        if key in self._of:
            return self._of[key]
        if not self._free:
            raise SlotError(f"no free sampling slot for sequence {key}: all "
                            f"{self.num_slots} are held")
        self._of[key] = slot = self._free.pop()
        self.generation[slot] += 1
        return slot

    def release(self, key: Hashable) -> None:
        slot = self._of.pop(key, None)
        if slot is not None:
            self._free.append(slot)

    @property
    def mapping(self) -> Mapping[Hashable, int]:
        """Sequence key -> slot of every sequence holding one (read-only view)."""
        return self._of

    def __len__(self) -> int:
        return len(self._of)


class _Chunk(Protocol):  # what batch building needs of a scheduled chunk
    start: int
    num_tokens: int

    @property
    def seq(self): ...


@dataclass
class StepInputs:
    """Host arrays of one step, already padded to ``bucket`` (see AttentionMetadata)."""

    bucket: Bucket
    token_ids: np.ndarray       # [T] int32
    positions: np.ndarray       # [T] int32
    slot_mapping: np.ndarray    # [T] int32
    seq_ids: np.ndarray         # [T] int32, -1 padding
    block_tables: np.ndarray    # [S, maxp] int32
    seq_lens: np.ndarray        # [S] int32
    logits_indices: np.ndarray  # [S] int32
    sampling: SamplingArrays    # [S] per-row sampling parameters


def build_step(chunks: Seq[_Chunk], *, is_prefill: bool, page_size: int,
               token_buckets: Seq[int], seq_buckets: Seq[int], page_buckets: Seq[int],
               request_seeds: Mapping[int, int],
               slots: Mapping[Hashable, int] | None = None) -> StepInputs:
    """Pack ``chunks`` (each: tokens [start, start+num_tokens) of one sequence) into a bucket.

    Args:
      chunks: scheduled chunks; decode chunks have num_tokens == 1.
      token_buckets / seq_buckets / page_buckets: the compiled sizes to choose from (for decode
        the token bucket equals the sequence bucket).
      request_seeds: seq_id -> seed of the request (the engine fills it per request); a
        row samples with that seed + the sequence's ``sample_index`` (0 when it has none).
      slots: ``Sequence.key`` -> penalty-state slot (``SlotTable.mapping``); rows of chunks
        that do not sample (a prompt chunk before the last) or without a slot get -1.
    Raises:
      BucketError: if the step exceeds every bucket.
    """
    if not chunks:
        raise BucketError("cannot build a step with no sequences")
    n_tok = sum(c.num_tokens for c in chunks)
    S = pick(seq_buckets, len(chunks), "sequence count")
    T = pick(token_buckets, n_tok, "token count") if is_prefill else S
    need_pages = max(-(-(c.start + c.num_tokens) // page_size) for c in chunks)
    P = pick(page_buckets, need_pages, "pages per sequence")
    bucket = Bucket("prefill" if is_prefill else "decode", T, S, P)

    token_ids = np.zeros(T, np.int32)
    positions = np.zeros(T, np.int32)
    slot_mapping = np.zeros(T, np.int32)  # padding -> null page 0
    seq_ids = np.full(T, -1, np.int32)
    block_tables = np.zeros((S, P), np.int32)
    seq_lens = np.zeros(S, np.int32)
    logits_indices = np.zeros(S, np.int32)
    sa = SamplingArrays.neutral(S)
    slots = slots or {}

    t = 0
    for row, c in enumerate(chunks):
        seq = c.seq
        end = c.start + c.num_tokens
        table = np.asarray(seq.block_table[:-(-end // page_size)], np.int32)
        block_tables[row, :len(table)] = table
        pos = np.arange(c.start, end, dtype=np.int32)
        # ScheduledChunk.token_ids slices without copying the whole history every step.
        toks = c.token_ids if hasattr(c, "token_ids") else seq.all_token_ids[c.start:end]
        token_ids[t:t + c.num_tokens] = np.asarray(toks, np.int32)
        positions[t:t + c.num_tokens] = pos
        slot_mapping[t:t + c.num_tokens] = table[pos // page_size] * page_size + pos % page_size
        seq_ids[t:t + c.num_tokens] = row
        seq_lens[row] = end
        logits_indices[row] = t + c.num_tokens - 1
        index = getattr(seq, "sample_index", 0)
        _fill_row(sa, row, seq, end, request_seeds.get(seq.seq_id, 0) + index,
                  slots.get((seq.seq_id, index), -1) if _samples(c) else -1)
        t += c.num_tokens
    return StepInputs(bucket, token_ids, positions, slot_mapping, seq_ids, block_tables,
                      seq_lens, logits_indices, sa)


def _samples(c: _Chunk) -> bool:
    """Whether the chunk ends at its sequence's last token (its logits give a new token)."""
    s = getattr(c, "samples", None)
    return bool(s) if s is not None else c.start + c.num_tokens == len(c.seq.all_token_ids)


def _fill_row(sa: SamplingArrays, row: int, seq: Any, end: int, seed: int, slot: int) -> None:
    sp = seq.sampling_params
    sa.temperature[row] = sp.temperature
    sa.top_k[row] = min(max(sp.top_k, 0), _I32_MAX)  # beyond the vocabulary keeps all
    sa.top_p[row] = sp.top_p
    sa.min_p[row] = sp.min_p
    sa.repetition_penalty[row] = sp.repetition_penalty
    sa.presence_penalty[row] = sp.presence_penalty
    sa.frequency_penalty[row] = sp.frequency_penalty
    sa.seeds[row] = (seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF)
    sa.sample_index[row] = end - seq.num_prompt_tokens
    sa.slots[row] = slot
    sa.want_logprobs[row] = sp.logprobs is not None
    sa.min_tokens[row] = sp.min_tokens if slot >= 0 else 0  # its stop flags live in the slot
    sa.allowed_only[row] = (bool(sp.allowed_token_ids) or sp.structured_outputs is not None
                            ) and slot >= 0  # (so do these)
    has_tables = bool(sp.logit_bias) or bool(sp.bad_words)  # (in the slot too)
    sa.has_bias[row] = has_tables and slot >= 0
