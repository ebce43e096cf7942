"""The scheduler's vocabulary: its configuration, its errors and what one step schedules.

Plain Python, no JAX (as ``scheduler.py``); split out of it to keep each module small.
``jaxinfer.scheduler`` re-exports every name here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from jaxinfer.block_manager import PageCopy
from jaxinfer.config import ConfigError
from jaxinfer.sequence import Sequence

if TYPE_CHECKING:
    from collections.abc import Sequence as Seq

    from jaxinfer.config import EngineConfig


class QueueFullError(ValueError):
    """``add()`` past ``max_queue_len`` requests waiting for a place."""


class RequestTooLongError(ValueError):
    """A request's prompt + max_tokens can never fit max_model_len or the KV pool."""


class TooManySamplesError(ValueError):
    """A request asks for more samples (``n``) than ``max_num_seqs`` sequences can run."""


class DuplicateRequestError(ValueError):
    """``add()`` of a seq_id that is already waiting or running."""


class SequenceStateError(ValueError):
    """A sequence in the wrong state was passed in (e.g. ``add()`` of a used sequence, or
    ``postprocess()`` of an output twice)."""


@dataclass
class SchedulerConfig:
    """Limits of the scheduler (vLLM's names).

    Attributes:
      max_num_seqs: most running sequences (the largest decode batch).
      max_num_batched_tokens: most tokens in one step (prefill: prompt tokens; decode: one
        per sequence); must be >= max_num_seqs.
      max_model_len: longest prompt + max_tokens accepted, in tokens.
      page_size: tokens per KV page.
      num_pages: pages in the pool, null page 0 included.
      max_prefill_seqs: most sequences (chunks) in one prefill step.
      max_queue_len: most requests waiting for a place that ``add()`` accepts (those the
        free ``max_num_seqs`` places take at the next step do not count); None = unbounded.
      enable_chunked_prefill: split prompts longer than the step's token budget; when off,
        max_num_batched_tokens must be >= max_model_len.
      enable_prefix_caching: share computed full prompt pages between requests (default on).
      max_consecutive_prefills: prefill steps in a row before a decode step is forced while
        sequences are decoding (>= 1); None = prefill first (v1).
      eos_token_ids: the model's end-of-sequence ids.
    Raises:
      ConfigError: on a value out of range, naming it.
    """

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    page_size: int
    num_pages: int
    max_prefill_seqs: int = 8
    max_queue_len: int | None = None
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    max_consecutive_prefills: int | None = 1
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "page_size",
                     "num_pages", "max_prefill_seqs"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"SchedulerConfig.{name} must be a positive int, got {v!r}")
        if self.num_pages < 2:
            raise ConfigError(f"SchedulerConfig.num_pages must be >= 2 (null page included), "
                              f"got {self.num_pages}")
        if self.max_queue_len is not None and (
                isinstance(self.max_queue_len, bool) or not isinstance(self.max_queue_len, int)
                or self.max_queue_len < 1):
            raise ConfigError(f"SchedulerConfig.max_queue_len must be None or a positive int, "
                              f"got {self.max_queue_len!r}")
        k = self.max_consecutive_prefills
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ConfigError(f"SchedulerConfig.max_consecutive_prefills must be None or a "
                              f"positive int, got {k!r}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ConfigError(
                f"SchedulerConfig.max_num_batched_tokens ({self.max_num_batched_tokens}) must "
                f"be >= max_num_seqs ({self.max_num_seqs}): a decode step feeds one token each")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ConfigError(
                f"SchedulerConfig.max_num_batched_tokens ({self.max_num_batched_tokens}) must "
                f"be >= max_model_len ({self.max_model_len}) when chunked prefill is off")
        self.eos_token_ids = tuple(self.eos_token_ids)
        for t in self.eos_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ConfigError(f"SchedulerConfig.eos_token_ids must hold ints >= 0, got {t!r}")

    @classmethod
    def from_engine_config(cls, engine: EngineConfig, eos_token_ids: Seq[int] = (),
                           **overrides: Any) -> SchedulerConfig:
        """The scheduler limits of an ``EngineConfig`` (block_size -> page_size,
        total_kv_pages -> num_pages; the engine passes the page count it sized from memory as
        an override); keyword arguments override fields. EngineConfig fields that do not
        exist (older configs) keep this class's defaults."""
        kw: dict[str, Any] = {
            "max_num_seqs": engine.max_num_seqs,
            "max_num_batched_tokens": engine.max_num_batched_tokens,
            "max_model_len": engine.max_model_len, "page_size": engine.block_size,
            "num_pages": engine.total_kv_pages, "max_prefill_seqs": engine.max_prefill_seqs,
            "eos_token_ids": tuple(eos_token_ids)}
        for name in ("max_queue_len", "enable_chunked_prefill", "enable_prefix_caching",
                     "max_consecutive_prefills"):
            if hasattr(engine, name):
                kw[name] = getattr(engine, name)
        kw.update(overrides)
        return cls(**kw)


@dataclass
class ScheduledChunk:
    """This step computes tokens ``[start, start + num_tokens)`` of ``seq.all_token_ids``
    (positions equal indices). ``samples`` (fixed when scheduled): the chunk ends at the
    sequence's last token, so the token sampled from its last logits is a new output token."""

    seq: Sequence
    start: int
    num_tokens: int
    _samples: bool = field(init=False, repr=False)

    def __post_init__(self) -> None:
        seq = self.seq  # made per sequence per step: no property calls
        self._samples = (self.start + self.num_tokens
                         == len(seq.prompt_token_ids) + len(seq.output_token_ids))

    @property
    def samples(self) -> bool:
        return self._samples

    @property
    def token_ids(self) -> list[int]:
        """The ``num_tokens`` token ids this chunk feeds."""
        prompt, end = self.seq.prompt_token_ids, self.start + self.num_tokens
        if end <= len(prompt):
            return prompt[self.start:end]
        out = self.seq.output_token_ids[max(0, self.start - len(prompt)):end - len(prompt)]
        return prompt[self.start:] + out


@dataclass
class SchedulerOutput:
    """One step's plan. Decode: one chunk per sequence with ``start = num_tokens - 1``.
    ``preempted``: sequences that lost their pages while this plan was made.
    ``page_copies``: copy-on-write page copies of samples forked for this step; the device
    must run them before the step."""

    is_prefill: bool
    chunks: list[ScheduledChunk]
    preempted: list[Sequence] = field(default_factory=list)
    page_copies: list[PageCopy] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.chunks

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class StepResult(NamedTuple):
    """What ``postprocess`` returns: the step's new (sequence, token) pairs in chunk order,
    and the sequences that finished (pages already freed)."""

    new_tokens: list[tuple[Sequence, int]]
    finished: list[Sequence]
