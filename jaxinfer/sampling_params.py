"""Per-request sampling parameters (names and meanings as in vLLM's ``SamplingParams``)."""

from __future__ import annotations

from dataclasses import dataclass, field


class ParameterError(ValueError):
    """A request parameter is out of its allowed range; the message names the field."""


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop.

    Attributes:
      temperature: softmax temperature, >= 0; 0 means greedy (argmax).
      top_k: keep the k most likely tokens; -1 (or 0) keeps all.
      top_p: keep the smallest set of tokens whose probability sums to >= top_p, in (0, 1].
      max_tokens: most new tokens to generate, >= 1.
      min_tokens: EOS and stop tokens are not honoured before this many new tokens.
      ignore_eos: keep generating past EOS (benchmarks use this for fixed output lengths).
      stop_token_ids: extra token ids that end the sequence.
      seed: per-request seed; the same seed gives the same tokens whatever else is batched.
      n: samples per prompt (only 1 in this version).
    Raises:
      ParameterError: on a value outside its range, naming the field and the range.
    """

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    max_tokens: int = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    n: int = 1

    def __post_init__(self) -> None:
        def num(name: str, v: object, kinds: tuple[type, ...]) -> None:
            if isinstance(v, bool) or not isinstance(v, kinds):
                raise ParameterError(f"{name} must be a number, got {v!r}")

        num("temperature", self.temperature, (int, float))
        if not self.temperature >= 0.0 or self.temperature != self.temperature:
            raise ParameterError(f"temperature must be >= 0, got {self.temperature}")
        num("top_k", self.top_k, (int,))
        if self.top_k < -1:
            raise ParameterError(f"top_k must be -1 (disabled) or >= 1, got {self.top_k}")
        num("top_p", self.top_p, (int, float))
        if not 0.0 < self.top_p <= 1.0:
            raise ParameterError(f"top_p must be in (0, 1], got {self.top_p}")
        num("max_tokens", self.max_tokens, (int,))
        if self.max_tokens < 1:
            raise ParameterError(f"max_tokens must be >= 1, got {self.max_tokens}")
        num("min_tokens", self.min_tokens, (int,))
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ParameterError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        if self.n != 1:
            raise ParameterError(f"n must be 1 in this version, got {self.n}")
        if self.seed is not None:
            num("seed", self.seed, (int,))
            if not 0 <= self.seed < 2**63:
                raise ParameterError(f"seed must be in [0, 2**63), got {self.seed}")
        for t in self.stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ParameterError(f"stop_token_ids must hold non-negative ints, got {t!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
