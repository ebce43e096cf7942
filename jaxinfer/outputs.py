"""Results returned to callers (names as in vLLM: RequestOutput / CompletionOutput)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    """One generated sample.

    Attributes:
      index: sample index within the request (0 while n == 1).
      text: detokenized output (special tokens skipped).
      token_ids: generated token ids.
      finish_reason: None while running, then "stop" (EOS / stop token), "length"
        (max_tokens or max_model_len) or "abort".
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None


@dataclass
class RequestOutput:
    """State of one request after a step (or at the end of ``LLM.generate``)."""

    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    metrics: dict[str, float] = field(default_factory=dict)
