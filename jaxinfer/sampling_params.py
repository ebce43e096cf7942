"""Per-request sampling parameters (names, meanings and ranges as in vLLM's ``SamplingParams``)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

import numpy as np

# Most top logprobs a request may ask for per token (vLLM's default ``max_logprobs``); the
# compiled step always computes this many and returns the first ``logprobs`` of them.
MAX_LOGPROBS = 20
# Most samples per request (``n``). A request's samples also run at once, so the engine
# further requires n <= its max_num_seqs.
MAX_SAMPLES = 64
# Most ``logit_bias`` entries of a request (OpenAI's limit): the width of the per-slot bias
# table on the device (``sampling_penalties.LogitBias``).
MAX_LOGIT_BIAS = 300
# Largest |logit_bias| value. OpenAI's API takes [-100, 100]; larger values are refused
# because the sampler's float32 loses them: near 1e30 biased logits tie (the Gumbel noise
# no longer separates them) and past ~3e32 / temperature they overflow to inf (NaN in min-p).
MAX_ABS_LOGIT_BIAS = 1e4


class ParameterError(ValueError):
    """A request parameter is out of its allowed range; the message names the field."""


def _number(name: str, v: object, integer: bool = False) -> Any:
    """``v`` as a Python int (``integer``) or float: numpy scalars are taken, bools,
    non-numbers and floats that are not finite in float32 raise ParameterError naming
    ``name``."""
    kind = numbers.Integral if integer else numbers.Real
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, kind):
        raise ParameterError(f"{name} must be {'an int' if integer else 'a number'}, "
                             f"got {v!r}")
    if integer:
        return int(v)  # type: ignore[call-overload]
    try:
        v = float(v)  # type: ignore[arg-type]
    except OverflowError:  # an int past float64 (10**400)
        raise ParameterError(f"{name} must fit float32 (|x| <= {_F32_MAX:.4g}), got an int "
                             f"of {len(str(v))} digits") from None
    if not math.isfinite(v):
        raise ParameterError(f"{name} must be finite, got {v!r}")
    if abs(v) > _F32_MAX:  # the sampler's float32 would make it inf (e.g. temperature 1e300)
        raise ParameterError(f"{name} must fit float32 (|x| <= {_F32_MAX:.4g}), got {v!r}")
    return float(v)  # type: ignore[arg-type]


_F32_MAX = float(np.finfo(np.float32).max)
_F32_TINY = float(np.finfo(np.float32).tiny)


# Numeric fields, normalized to Python numbers before their ranges are checked: (name,
# integer, may be None).
_NUMERIC = (("temperature", False, False), ("top_k", True, False), ("top_p", False, False),
            ("max_tokens", True, True), ("min_tokens", True, False), ("seed", True, True),
            ("n", True, False), ("min_p", False, False), ("repetition_penalty", False, False),
            ("presence_penalty", False, False), ("frequency_penalty", False, False),
            ("logprobs", True, True), ("prompt_logprobs", True, True),
            ("truncate_prompt_tokens", True, True))


def _kind(v: object) -> str:
    """``v`` for a message: its type and a short repr."""
    r = repr(v)
    return f"{type(v).__name__} {r if len(r) <= 40 else r[:37] + '...'}"


def _token_ids(name: str, ids: object) -> list[int]:
    """``ids`` as a list of ints >= 0; raises ParameterError naming ``name`` and the entry."""
    if not isinstance(ids, (list, tuple)):
        raise ParameterError(f"{name} must be a list of token ids (ints >= 0), got "
                             f"{_kind(ids)}")
    out = []
    for i, t in enumerate(ids):
        if isinstance(t, (bool, np.bool_)) or not isinstance(t, numbers.Integral) or t < 0:
            raise ParameterError(f"{name} must hold non-negative ints, got {t!r} at {name}[{i}]")
        out.append(int(t))
    return out


def _logit_bias(bias: object) -> dict[int, float] | None:
    """``bias`` as {token id: float}, None when empty; raises ParameterError naming the
    entry for a key that is not an int >= 0, a value that is not a finite float32, or more
    than MAX_LOGIT_BIAS entries."""
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise ParameterError(f"logit_bias must be a dict of token id -> bias, got {_kind(bias)}")
    if len(bias) > MAX_LOGIT_BIAS:
        raise ParameterError(f"logit_bias has {len(bias)} entries; at most {MAX_LOGIT_BIAS}")
    out = {}
    for t, v in bias.items():
        if isinstance(t, (bool, np.bool_)) or not isinstance(t, numbers.Integral) or t < 0:
            raise ParameterError(f"logit_bias keys must be token ids (ints >= 0), got {t!r}")
        out[int(t)] = b = _number(f"logit_bias[{t}]", v)
        if abs(b) > MAX_ABS_LOGIT_BIAS:
            raise ParameterError(f"logit_bias[{t}] must be in [-{MAX_ABS_LOGIT_BIAS:g}, "
                                 f"{MAX_ABS_LOGIT_BIAS:g}] (OpenAI's range is [-100, 100]: "
                                 f"-100 all but bans a token), got {b:g}")
    return out or None


def _flag(name: str, v: object) -> None:
    if not isinstance(v, (bool, np.bool_)):
        raise ParameterError(f"{name} must be a bool, got {v!r}")


OUTPUT_KINDS = ("cumulative", "delta", "final_only")  # vLLM's RequestOutputKind, lower case


@dataclass
class SamplingParams:
    """How to pick each next token, what to return, and when to stop.

    Each token is drawn as in vLLM v1's sampler: the raw logits get the penalties
    (repetition, then frequency and presence), then greedy rows take the argmax; other rows
    divide by ``temperature``, drop tokens below ``min_p`` times the top probability, keep
    the ``top_k`` best and the ``top_p`` nucleus of what is left, and draw from the rest.

    Attributes:
      temperature: softmax temperature, >= 0; 0 means greedy (argmax).
      top_k: keep the k most likely tokens; -1 or 0 keeps all.
      top_p: keep the smallest set of most likely tokens whose probability sums to
        >= top_p, in (0, 1].
      min_p: drop tokens whose probability is below ``min_p`` times the most likely
        token's, in [0, 1]; 0 = off.
      repetition_penalty: > 0 (>= 1.175e-38, float32's smallest normal number); logits of
        tokens seen in the prompt or the output are divided by it when positive and
        multiplied when negative (HF / vLLM; 1 = off).
      presence_penalty: in [-2, 2]; subtracted once from the logit of every token present
        in the output so far (OpenAI semantics; prompt tokens do not count).
      frequency_penalty: in [-2, 2]; subtracted from each token's logit once per time it
        occurs in the output so far (OpenAI semantics).
      seed: per-request seed in [0, 2**63); the same seed gives the same tokens whatever
        else is batched. None: the engine draws one (unseeded requests differ). Sample i of
        an ``n > 1`` request draws with ``seed + i`` (as vLLM v1's parallel sampling), so
        its samples differ from each other and sample i of seed s equals sample 0 of s + i.
      max_tokens: most new tokens to generate, >= 1; None: as many as fit
        ``max_model_len`` after the prompt (vLLM's meaning; the engine sets it when it
        queues the request, and caps ``min_tokens`` at it).
      min_tokens: EOS, ``stop_token_ids`` and ``stop`` strings do not end the output before
        this many new tokens, in [0, max_tokens]. Until then EOS (unless ``ignore_eos``)
        and ``stop_token_ids`` are masked (logits -inf; logprobs stay raw), as vLLM v1's
        ``MinTokensLogitsProcessor``; a stop string may still appear in the text then.
      stop: strings that end the output; the text is cut before the first one found (after
        it with ``include_stop_str_in_output``). A str is one stop string; else a list or
        tuple of non-empty strs.
      stop_token_ids: extra token ids that end the sequence (the token stays in token_ids,
        its text is left out); a list or tuple of ints >= 0 (the engine checks them against
        the vocabulary).
      allowed_token_ids: sample only among these token ids (vLLM's; every other logit is
        -inf; logprobs stay raw); None allows all. A non-empty list or tuple of ints >= 0
        (the engine checks them against the vocabulary).
      logit_bias: {token id: bias} added to those tokens' logits before the penalties and
        the other processing (OpenAI's / vLLM v1's ``LogitBiasLogitsProcessor``; logprobs
        stay raw); None or {} = none. Keys ints >= 0 (the engine checks them against the
        vocabulary), values in [-1e4, 1e4] (OpenAI's API takes [-100, 100]: -100 all but
        bans a token, +100 all but forces it; larger ones would tie or overflow in the
        sampler's float32), at most 300 entries (OpenAI's limit).
      bad_words: words never generated (vLLM's): each is encoded with and without a leading
        space, and a word's last token is banned (logit -inf) whenever the output so far
        ends with its other tokens -- a one-token word is always banned
        (:mod:`jaxinfer.sampling_bad_words`). A str is one word; else a list or tuple of
        non-empty strs; None or [] = none. The engine encodes them (a model without a
        tokenizer refuses them; at most 128 token sequences of at most 16 tokens).
      include_stop_str_in_output: keep the matched stop string in the text, and the text of
        the token that ended the sequence (EOS or a stop token id), as vLLM v1.
      ignore_eos: keep generating past EOS (benchmarks use this for fixed output lengths).
      logprobs: None = off; k in [0, 20]: return, per generated token, the chosen token's
        log-probability and the k most likely tokens' (log-softmax of the raw logits, before
        penalties and temperature -- vLLM v1's default ``raw_logprobs``).
      prompt_logprobs: None = off; k in [0, 20]: the same for every prompt token after
        the first (each position scored given the tokens before it).
      skip_special_tokens: drop special tokens (EOS, turn markers) from the text.
      detokenize: build the text (vLLM's); False leaves ``text`` empty and saves the
        detokenizer's host time (token ids and logprobs are unchanged); stop strings need
        it.
      truncate_prompt_tokens: keep only the last k tokens of the prompt (left truncation,
        as vLLM); -1 means max_model_len; None keeps it whole. A text prompt keeps the
        special tokens the tokenizer adds (BOS) and loses text tokens from its start, as a
        transformers tokenizer with ``truncation_side="left"``; a chat's rendered ids and
        token-id prompts lose their first ids. k > max_model_len is refused by the engine.
      n: samples per prompt, in [1, 64] (and at most the engine's ``max_num_seqs``). The
        prompt is prefilled once; the samples share its KV pages and each has its own
        decode pages (``RequestOutput.outputs`` holds n ``CompletionOutput``s, index 0..n-1).
        Greedy samples are identical.
      structured_outputs: a ``structured_outputs.StructuredOutputsParams`` (or a dict of its
        fields): the output must match a JSON schema, any JSON object, a regex, one of a list
        of strings or a grammar (vLLM's structured outputs; tokens that would leave it are
        masked before sampling, as ``allowed_token_ids`` masks; the engine checks the grammar
        against the model's tokenizer). Such a request decodes one step a program (no
        multi-step windows or pipelined steps while it runs). None = unconstrained.
      output_kind: what ``LLMEngine.step`` returns for the request (vLLM's
        ``RequestOutputKind``): "cumulative" (every step: all tokens, text and logprobs so
        far), "delta" (every step: only what is new since the request's previous output) or
        "final_only" (one output, when the request finishes). Per-step outputs cost host time
        that grows with the output length for "cumulative" (a copy of the token ids per row
        and step); ``LLM.generate`` uses "final_only", ``jaxinfer bench`` "delta".
    Numbers may be numpy scalars (``np.int64(5)``); they are stored as Python ints and floats.

    Raises:
      ParameterError: on a value outside its range, naming the field and the range.
    """

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    n: int = 1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: list[str] | str | None = None
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    detokenize: bool = True
    truncate_prompt_tokens: int | None = None
    allowed_token_ids: list[int] | None = None
    logit_bias: dict[int, float] | None = None
    bad_words: list[str] | None = None
    output_kind: str = "cumulative"
    structured_outputs: Any = None
    # The engine's encoding of ``bad_words`` (``sampling_bad_words.bad_words_token_ids``:
    # list[list[int]]), set on its own copy when it accepts the request. Not a field (no
    # annotation): not an argument, and ``dataclasses.replace`` copies start without it.
    bad_words_token_ids = None

    def __post_init__(self) -> None:
        for name, integer, optional in _NUMERIC:  # np.int64(5) -> 5, 1 -> 1.0, ...
            v = getattr(self, name)
            if not (optional and v is None):
                setattr(self, name, _number(name, v, integer))
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens",
                     "detokenize"):
            _flag(name, getattr(self, name))
            setattr(self, name, bool(getattr(self, name)))
        if not 1 <= self.n <= MAX_SAMPLES:
            raise ParameterError(f"n must be in [1, {MAX_SAMPLES}], got {self.n}")
        if self.temperature < 0.0:
            raise ParameterError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < -1:
            raise ParameterError(f"top_k must be -1 or 0 (disabled) or >= 1, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ParameterError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ParameterError(f"min_p must be in [0, 1], got {self.min_p}")
        if not self.repetition_penalty >= _F32_TINY:
            # (one below float32's smallest normal number, e.g. 1e-38, is 0 on a device
            # that flushes subnormals, and was taken as "off")
            raise ParameterError(f"repetition_penalty must be > 0 (at least "
                                 f"{_F32_TINY:.4g}, float32's smallest normal number), got "
                                 f"{self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ParameterError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ParameterError(f"max_tokens must be >= 1 or None, got {self.max_tokens}")
        if self.min_tokens < 0 or self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ParameterError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
                if self.max_tokens is not None else f"min_tokens must be >= 0, got "
                f"{self.min_tokens}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ParameterError(f"seed must be in [0, 2**63), got {self.seed}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and not 0 <= v <= MAX_LOGPROBS:
                raise ParameterError(f"{name} must be None or in [0, {MAX_LOGPROBS}], got {v}")
        t = self.truncate_prompt_tokens
        if t is not None and not (t == -1 or t >= 1):
            raise ParameterError(f"truncate_prompt_tokens must be None, -1 (max_model_len) or "
                                 f">= 1, got {t}")
        if self.output_kind not in OUTPUT_KINDS:
            raise ParameterError(f"output_kind must be one of {', '.join(OUTPUT_KINDS)}, got "
                                 f"{self.output_kind!r}")
        self.stop_token_ids = _token_ids("stop_token_ids", self.stop_token_ids)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _token_ids("allowed_token_ids", self.allowed_token_ids)
            if not self.allowed_token_ids:
                raise ParameterError("allowed_token_ids is empty: no token could be sampled "
                                     "(None allows all)")
        self.logit_bias = _logit_bias(self.logit_bias)
        self.stop = _strings("stop", self.stop)
        if self.stop and not self.detokenize:
            raise ParameterError("stop strings need detokenize=True (they are matched in the "
                                 "text); use stop_token_ids")
        self.bad_words = _strings("bad_words", self.bad_words, blank_ok=False) or None
        if self.structured_outputs is not None:
            from jaxinfer.structured_outputs import StructuredOutputsParams

            so = self.structured_outputs
            if isinstance(so, dict):
                known = [f.name for f in fields(StructuredOutputsParams)]
                if unknown := [k for k in so if k not in known]:
                    raise ParameterError(f"structured_outputs has no field {unknown[0]!r} "
                                         f"(fields: {', '.join(known)})")
                so = StructuredOutputsParams(**so)
            if not isinstance(so, StructuredOutputsParams):
                raise ParameterError("structured_outputs must be a StructuredOutputsParams "
                                     f"(or a dict of its fields), got {_kind(so)}")
            self.structured_outputs = so

    @property
    def greedy(self) -> bool:
        """Temperature 0: the argmax of the (penalized) logits."""
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        """Any of repetition / presence / frequency penalty is not neutral."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    @property
    def stop_strings(self) -> list[str]:
        """``stop`` as a list (``__post_init__`` normalizes it)."""
        return self.stop if isinstance(self.stop, list) else []


def _strings(name: str, v: object, blank_ok: bool = True) -> list[str]:
    """``stop`` / ``bad_words`` as a list of non-empty strs (None -> [], a str -> [it]; with
    ``blank_ok`` False, none of only spaces); raises ParameterError naming the field and the
    bad entry."""
    if v is not None and not isinstance(v, (str, list, tuple)):
        raise ParameterError(f"{name} must be None, a string or a list of strings, "
                             f"got {_kind(v)}")
    out = [] if v is None else [v] if isinstance(v, str) else list(v)
    for i, s in enumerate(out):
        if not isinstance(s, str) or not (s if blank_ok else s.strip()):
            raise ParameterError(f"{name} must hold non-empty strings, got {s!r} at "
                                 f"{name}[{i}]")
    return out


def with_output_kind(params: Sequence[SamplingParams], kind: str) -> list[SamplingParams]:
    """Copies of ``params`` with ``output_kind=kind``, one copy per distinct object (a list
    holding one SamplingParams N times gets one copy N times); the originals are untouched.
    Raises ParameterError for a ``kind`` not in OUTPUT_KINDS."""
    copies = {id(sp): replace(sp, output_kind=kind) for sp in params}
    return [copies[id(sp)] for sp in params]
