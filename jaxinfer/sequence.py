"""The state of one request: its tokens, its block table, its status (after nano-vllm's
``Sequence``; vLLM v1's ``Request``).

Token bookkeeping: ``all_token_ids = prompt_token_ids + output_token_ids``. The K/V of the
first ``num_computed_tokens`` of them are in the KV cache. While decoding, exactly the last
token lacks K/V (``num_computed_tokens == num_tokens - 1``): the next step feeds it and
samples the token after it. Plain Python; no JAX.

A request with ``n > 1`` samples is a :class:`SequenceGroup`: sample 0 is the sequence added
to the scheduler; it prefills the prompt up to (not including) its last token, then the
scheduler forks samples 1..n-1 from it (``fork``), which share its prompt pages. Every sample
then feeds the last prompt token in a decode step and samples its own tokens. All samples of a
request share its ``seq_id``; ``key`` = (seq_id, sample_index) tells them apart.

Prefix caching (``block_manager``) adds three fields: the hash chain of the sequence's full
pages (computed once, kept across preemption since tokens are append-only), how many leading
pages of the block table were already offered to the prefix cache, and how many prompt tokens
the last admission took from the cache instead of computing them.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from jaxinfer.sampling_params import SamplingParams


class InvalidPromptError(ValueError):
    """A request's prompt token ids are empty or not non-negative integers."""


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()   # in the scheduler's queue; holds no pages
    RUNNING = enum.auto()   # admitted; holds pages (prefilling or decoding)
    FINISHED = enum.auto()  # stopped ("stop" | "length" | "abort"); pages returned


@dataclass(eq=False)
class SequenceGroup:
    """The samples of one request (vLLM's ``SequenceGroup``).

    Attributes:
      request_id: the samples' ``seq_id``.
      n: samples asked for (``SamplingParams.n``).
      samples: the samples that exist so far, by index: sample 0 from the start, the
        others once forked (then all n).
    """

    request_id: int
    n: int
    samples: list[Sequence]

    @property
    def is_finished(self) -> bool:
        """Every sample finished (an unforked request: sample 0 finished, e.g. aborted)."""
        for s in self.samples:  # a loop, not all(<generator>): asked per request per step
            if s.status is not SequenceStatus.FINISHED:
                return False
        return True


@dataclass(eq=False)
class Sequence:
    """One request as the scheduler and block manager see it.

    Attributes:
      seq_id: caller-chosen request id, unique among the scheduler's unfinished requests;
        all samples of a request share it.
      sample_index: which of the request's ``n`` samples this is (0 .. n-1).
      prompt_token_ids: the prompt, token ids (>= 0), non-empty.
      sampling_params: how to sample and when to stop.
      arrival_time: ``time.monotonic()`` seconds when created.
      output_token_ids: tokens generated so far (kept across preemption).
      block_table: page ids in order; token ``p`` lives in page ``block_table[p // page_size]``.
      num_computed_tokens: leading tokens of ``all_token_ids`` whose K/V are in the cache.
      status: WAITING, RUNNING or FINISHED.
      finish_reason: None until finished, then "stop", "length" or "abort".
      num_preemptions: times this sequence lost its pages and went back to waiting.
      num_cached_tokens: leading tokens whose K/V came from the prefix cache at the last
        admission (vLLM's ``num_cached_tokens``); 0 without a hit.
      page_hashes: hash-chain keys of the full pages of ``all_token_ids`` (filled and used by
        the block manager only; valid for one page size).
      num_registered_pages: leading block-table pages already offered to the prefix cache.
      fork_pending: sample 0 of an ``n > 1`` request that has not forked yet: it prefills
        up to its last prompt token only (set at creation, cleared by the fork).
      group: the request's :class:`SequenceGroup` (shared by its samples).
    Raises:
      InvalidPromptError: on an empty prompt or a token id that is not an int >= 0.
    """

    seq_id: int
    prompt_token_ids: list[int]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0
    page_hashes: list[bytes] = field(default_factory=list, repr=False)
    num_registered_pages: int = field(default=0, repr=False)
    sample_index: int = 0
    fork_pending: bool = field(init=False, repr=False)
    group: SequenceGroup = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.prompt_token_ids = list(self.prompt_token_ids)
        if not self.prompt_token_ids:
            raise InvalidPromptError(f"sequence {self.seq_id}: prompt_token_ids is empty")
        for t in self.prompt_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise InvalidPromptError(
                    f"sequence {self.seq_id}: prompt token ids must be ints >= 0, got {t!r}")
        self.fork_pending = self.sampling_params.n > 1 and self.sample_index == 0
        self.group = SequenceGroup(self.seq_id, self.sampling_params.n, [self])

    def fork(self, index: int) -> Sequence:
        """A new sample ``index`` of this request: same prompt, parameters and arrival, no
        outputs, no pages (the block manager shares them: ``BlockManager.fork``), in this
        sequence's group. The caller (the scheduler) sets its status and computed tokens."""
        child = Sequence(self.seq_id, self.prompt_token_ids, self.sampling_params,
                         arrival_time=self.arrival_time, sample_index=index)
        child.group = self.group
        self.group.samples.append(child)
        return child

    @property
    def key(self) -> tuple[int, int]:
        """(seq_id, sample_index): unique among the scheduler's sequences."""
        return (self.seq_id, self.sample_index)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt followed by outputs (a new list; what a (re-)prefill computes)."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def last_token_id(self) -> int:
        """The newest token: the one a decode step feeds."""
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def num_pages(self, page_size: int) -> int:
        """Pages needed to hold all ``num_tokens`` tokens: ceil(num_tokens / page_size)."""
        return -(-self.num_tokens // page_size)

    def __repr__(self) -> str:
        sample = f", sample={self.sample_index}" if self.sampling_params.n > 1 else ""
        return (f"Sequence(seq_id={self.seq_id}{sample}, status={self.status.name}, "
                f"prompt={self.num_prompt_tokens}, output={self.num_output_tokens}, "
                f"computed={self.num_computed_tokens}, cached={self.num_cached_tokens}, "
                f"pages={len(self.block_table)}, "
                f"finish_reason={self.finish_reason!r})")
