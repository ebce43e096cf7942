"""Results returned to callers (names as in vLLM: RequestOutput / CompletionOutput), and the
host-side state that builds them per request: incremental detokenization, stop strings,
logprobs. Plain Python; no JAX.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from jaxinfer.sampling_params import SamplingParams
    from jaxinfer.tokenizer import Tokenizer

# Per position: {token id: log-probability}; the token actually there comes first.
Logprobs = dict[int, float]


@dataclass
class CompletionOutput:
    """One generated sample.

    Attributes:
      index: sample index within the request, 0 .. n-1 (``SamplingParams.n``).
      text: detokenized output (special tokens skipped unless ``skip_special_tokens=False``;
        cut before a matched stop string). While running, the last ``len(longest stop) - 1``
        characters are held back, so a stop string never shows and then vanishes.
      token_ids: generated token ids (all of them, including those of a matched stop string
        and a stop token).
      finish_reason: None while running, then "stop" (EOS, a stop token or a stop string),
        "length" (max_tokens or max_model_len) or "abort".
      logprobs: with ``SamplingParams.logprobs = k``: per generated token, the chosen token's
        log-probability and the k most likely tokens' (raw logits' log-softmax); else None.
      cumulative_logprob: sum of the chosen tokens' log-probabilities (with ``logprobs``).
      stop_reason: the stop string or stop token id that ended the output; None for EOS.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[Logprobs] | None = None
    cumulative_logprob: float | None = None
    stop_reason: int | str | None = None


@dataclass
class RequestOutput:
    """State of one request after a step (or at the end of ``LLM.generate``).

    ``outputs``: one CompletionOutput per sample, index 0 .. n-1 (a sample not forked yet,
    see ``sequence.SequenceGroup``, is empty); ``finished``: every sample has finished.
    ``prompt_logprobs`` (with ``SamplingParams.prompt_logprobs = k``): one entry per prompt
    token, None for the first, then the token's log-probability given the tokens before it
    and the k most likely tokens' there.
    """

    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    metrics: dict[str, float] = field(default_factory=dict)
    prompt_logprobs: list[Logprobs | None] | None = None


def find_stop_string(text: str, num_new_chars: int, stops: Seq[str]) -> tuple[int, str] | None:
    """The earliest stop string that ends within the last ``num_new_chars`` chars of text.

    Returns (index where it starts, the string), or None. Source: vLLM's
    ``check_stop_strings`` (searches only where a new match can be), taking the earliest
    match instead of the first string in the list that matches.
    """
    best: tuple[int, str] | None = None
    if num_new_chars <= 0:
        return None
    for s in stops:
        i = text.find(s, max(0, len(text) - num_new_chars - len(s) + 1))
        if i != -1 and (best is None or i < best[0]):
            best = (i, s)
    return best


def logprobs_entry(token: int, chosen: float, top_ids: np.ndarray, top_vals: np.ndarray,
                   k: int) -> Logprobs:
    """{chosen token: its logprob, then the k best tokens: theirs} (vLLM's layout)."""
    d = {int(token): float(chosen)}
    for i, v in zip(top_ids[:k].tolist(), top_vals[:k].tolist()):
        d.setdefault(int(i), float(v))
    return d


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """[..., V] -> float64 log-softmax over the last axis."""
    x = np.asarray(logits, np.float64)
    m = x.max(-1, keepdims=True)
    return x - (m + np.log(np.exp(x - m).sum(-1, keepdims=True)))


def top_k_ids(lp: np.ndarray, k: int) -> np.ndarray:
    """[N, V] -> [N, k] ids of the k largest per row, largest first (ties: lower id)."""
    if k <= 0:
        return np.zeros((lp.shape[0], 0), np.int64)
    part = np.argpartition(-lp, k - 1, axis=-1)[:, :k]
    vals = np.take_along_axis(lp, part, -1)
    order = np.lexsort((part, -vals), axis=-1)
    return np.take_along_axis(part, order, -1)


def prompt_logprobs_from_logits(logits: np.ndarray | None, prompt: Seq[int], k: int
                                ) -> list[Logprobs | None]:
    """vLLM's prompt_logprobs: [None] then, for i >= 1, {prompt[i]: its logprob, k best}.

    Args:
      logits: [len(prompt) - 1, V] raw logits at positions 0 .. n - 2 (None when n == 1).
      prompt: the prompt token ids.  k: top logprobs per position.
    """
    out: list[Logprobs | None] = [None]
    if logits is None or len(prompt) < 2:
        return out
    lp = log_softmax(logits)
    top = top_k_ids(lp, k)
    for i in range(len(prompt) - 1):
        tok = int(prompt[i + 1])
        out.append(logprobs_entry(tok, lp[i, tok], top[i], lp[i, top[i]], k))
    return out


class RequestState:
    """Host-side output state of one sample of a request: text, stop strings, logprobs.

    The text is built by an :class:`~jaxinfer.tokenizer.IncrementalDetokenizer` (work per
    token independent of the output length). Stop strings are searched only in the region
    that a new token's text can complete.

    Args:
      params: the request's SamplingParams.
      prompt_token_ids: the prompt (the detokenizer's left context).
      tokenizer: the model's tokenizer, or None (then text stays "" and stop strings are
        not allowed: the engine rejects them); text stays "" with ``params.detokenize``
        False too.
    """

    def __init__(self, params: SamplingParams, prompt_token_ids: Seq[int],
                 tokenizer: Tokenizer | None) -> None:
        from jaxinfer.detokenizer import IncrementalDetokenizer

        self.params = params
        self.detok = (IncrementalDetokenizer(tokenizer, prompt_token_ids,
                                             params.skip_special_tokens)
                      if tokenizer is not None and params.detokenize else None)
        self.stops = params.stop_strings
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.num_tokens = 0
        self.stop_match: tuple[int, str] | None = None
        self.logprobs: list[Logprobs] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob: float | None = 0.0 if params.logprobs is not None else None
        self._flushed = False
        self._sent_tokens = self._sent_chars = self._sent_logprobs = 0  # output_kind "delta"

    def add_token(self, token: int, logprob: Logprobs | None = None,
                  stop_token: bool = False) -> bool:
        """Record one generated token (and its logprobs entry); returns True when the text
        now contains a stop string. Like EOS in the scheduler, a stop string counts once
        ``min_tokens`` tokens exist; text completed before that is never searched again.

        ``stop_token``: the token ended the sequence (EOS or one of ``stop_token_ids``). It
        stays in the token ids but its text is left out unless ``include_stop_str_in_output``
        (vLLM v1's ``IncrementalDetokenizer.update``)."""
        self.num_tokens += 1
        if self.logprobs is not None and logprob is not None:
            self.logprobs.append(logprob)
            self.cumulative_logprob = (self.cumulative_logprob or 0.0) + logprob[int(token)]
        if self.detok is None or self.stop_match is not None:
            return False
        if stop_token and not self.params.include_stop_str_in_output:
            return False
        new = self.detok.step([token])
        if self.stops and self.num_tokens >= self.params.min_tokens:
            self.stop_match = find_stop_string(self.detok.output_text, len(new), self.stops)
        return self.stop_match is not None

    def _text_span(self, finished: bool) -> tuple[str, int]:
        """(the detokenized text, the end of what may be shown now): before a matched stop
        string (after it with ``include_stop_str_in_output``), else all of it once
        finished, else all but the held-back last ``hold`` characters."""
        assert self.detok is not None
        if self.stop_match is not None:
            i, s = self.stop_match
            return (self.detok.output_text,
                    i + len(s) if self.params.include_stop_str_in_output else i)
        if finished and not self._flushed:
            self.detok.flush()  # a dangling partial UTF-8 character, as U+FFFD
            self._flushed = True
        full = self.detok.output_text
        return full, len(full) if finished else max(0, len(full) - self.hold)

    def text(self, finished: bool) -> str:
        """The output text so far (see CompletionOutput.text)."""
        if self.detok is None:
            return ""
        full, end = self._text_span(finished)
        return full[:end]

    def completion(self, token_ids: Seq[int], finish_reason: str | None,
                   finished: bool, index: int = 0) -> CompletionOutput:
        """The CompletionOutput of this sample (``index``) after the latest step:
        everything so far, or with ``output_kind="delta"`` what is new since the last call
        (token ids, text and logprobs; the cumulative logprob stays the running sum).
        ``token_ids``: all of the sample's generated tokens (not copied unless returned)."""
        stop_reason: int | str | None = None
        if self.stop_match is not None:
            stop_reason = self.stop_match[1]
        elif finish_reason == "stop" and token_ids and token_ids[-1] in self.params.stop_token_ids:
            stop_reason = token_ids[-1]
        if self.params.output_kind != "delta":
            return CompletionOutput(
                index, self.text(finished), list(token_ids), finish_reason,
                list(self.logprobs) if self.logprobs is not None else None,
                self.cumulative_logprob, stop_reason)
        text = ""
        if self.detok is not None:
            full, end = self._text_span(finished)
            text, self._sent_chars = full[self._sent_chars:end], max(self._sent_chars, end)
        ids, self._sent_tokens = list(token_ids[self._sent_tokens:]), len(token_ids)
        lps = None
        if self.logprobs is not None:
            lps, self._sent_logprobs = self.logprobs[self._sent_logprobs:], len(self.logprobs)
        return CompletionOutput(index, text, ids, finish_reason, lps, self.cumulative_logprob,
                                stop_reason)


class RequestStates:
    """Host-side output state of a request: a :class:`RequestState` per sample (``params.n``
    of them), and the request's prompt logprobs (computed once, shared by the samples).

    Args: as :class:`RequestState`.
    """

    def __init__(self, params: SamplingParams, prompt_token_ids: Seq[int],
                 tokenizer: Tokenizer | None) -> None:
        self.samples = [RequestState(params, prompt_token_ids, tokenizer)
                        for _ in range(params.n)]
        self.prompt_logprobs: list[Logprobs | None] | None = None
        # One list for every RequestOutput of the request (not copied per step).
        self.prompt_token_ids = list(prompt_token_ids)

    def completions(self, seqs: Seq[Any]) -> list[CompletionOutput]:
        """One CompletionOutput per sample, by index; ``seqs`` are the samples that exist
        (``SequenceGroup.samples``: token ids, finish reason); the others are empty."""
        out: list[CompletionOutput | None] = [None] * len(self.samples)
        for s in seqs:
            i = s.sample_index
            out[i] = self.samples[i].completion(s.output_token_ids, s.finish_reason,
                                                s.is_finished, i)
        return [c if c is not None else CompletionOutput(i, "", []) for i, c in enumerate(out)]
