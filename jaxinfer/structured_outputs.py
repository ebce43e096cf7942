"""Structured outputs (vLLM's ``StructuredOutputsParams``): a request's output held to a JSON
schema, any JSON object, a regular expression, one of a list of strings or a context-free
grammar, by masking the tokens that would leave it before each token is sampled.

The masks come from llguidance (https://github.com/guidance-ai/llguidance; vLLM's "guidance"
structured-output backend, ``vllm/v1/structured_output/backend_guidance.py``): an
``LLMatcher`` per sequence walks the grammar over the sequence's output tokens and fills the
next token's allowed set as a bitmask ([W] int32, bit ``t % 32`` of word ``t // 32`` for token
``t``). The engine writes those masks into the ``allowed_token_ids`` flags of the rows'
penalty-state slots (``runner_slots.load_allowed_masks``), so the compiled sampler masks the
other tokens exactly as it does for ``allowed_token_ids`` (logits -inf; logprobs stay raw).
A sequence whose grammar is complete (no token may follow) finishes with reason "stop"; while
it is complete but may go on (a regex ``a+``), EOS is allowed.

Plain Python and numpy (no JAX): :class:`StructuredOutputsParams` checks a request's fields,
:class:`GrammarMatchers` checks grammars against the model's tokenizer and keeps the matchers.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from jaxinfer.sampling_params import ParameterError

log = logging.getLogger(__name__)

# The fields of StructuredOutputsParams that name a constraint, in vLLM's order, and the
# llguidance format of the text ones (``llguidance.grammar_from``).
KINDS = ("json", "regex", "choice", "grammar", "json_object")
_FORMATS = {"regex": "regex", "grammar": "grammar"}
_ERROR_CHARS = 300  # of llguidance's error messages (they can hold its whole parser state)


def _literal(text: str) -> str:
    r"""``text`` as a Rust-regex literal: ASCII letters and digits as they are, every other
    character as ``\x{HEX}`` (valid for any Unicode scalar, unlike backslash escapes)."""
    return "".join(c if c.isascii() and c.isalnum() else f"\\x{{{ord(c):X}}}" for c in text)


def _short_error(error: str) -> str:
    """A matcher's error without llguidance's dump of its parser state and grammar: its
    "Error: ..." line, else its first line, at most ``_ERROR_CHARS`` characters."""
    lines = [ln.strip() for ln in (error or "").strip().splitlines() if ln.strip()]
    line = next((ln for ln in lines if ln.startswith("Error:") and ln != "Error: None"),
                lines[0] if lines else "")
    return line if len(line) <= _ERROR_CHARS else line[:_ERROR_CHARS] + " [...]"
_ANY_OBJECT = '{"type": "object"}'  # json_object: any JSON object (OpenAI's json_object mode)


@dataclass(frozen=True)
class StructuredOutputsParams:
    """What a request's output must match (vLLM's ``StructuredOutputsParams``); exactly one
    field is set.

    Attributes:
      json: a JSON schema, as a dict or its JSON text (llguidance's JSON-schema subset:
        https://github.com/guidance-ai/llguidance/blob/main/docs/json_schema.md).
      regex: a regular expression the whole output matches (Rust ``regex`` syntax).
      choice: a non-empty list of strings; the output is one of them.
      grammar: a context-free grammar in Lark syntax (llguidance's dialect) or llama.cpp's
        GBNF (``root ::= ...``).
      json_object: True: any JSON object (OpenAI's ``response_format: json_object``).
      disable_any_whitespace: JSON (``json``, ``json_object``) without whitespace between
        its tokens (vLLM's; by default any whitespace may appear there, as JSON allows --
        a weak model may then emit whitespace until ``max_tokens``).
    The grammar is checked against the model's tokenizer when the engine takes the request.

    Raises:
      ParameterError: no field or more than one set, or a field of the wrong type (an empty
        choice list, a ``json`` text that is not JSON, a json_object that is not True).
    """

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: Sequence[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) is not None]
        if len(given) != 1:
            raise ParameterError(
                "structured_outputs must set exactly one of "
                f"{', '.join(KINDS)}; got {', '.join(given) if given else 'none'}")
        kind = given[0]
        v = getattr(self, kind)
        if kind == "json":
            if isinstance(v, str):
                try:
                    schema = json.loads(v)
                except ValueError as e:
                    raise ParameterError(f"structured_outputs.json is not JSON text: {e}") \
                        from None
                if not isinstance(schema, dict):  # (true / false schemas: not supported)
                    raise ParameterError("structured_outputs.json must be a JSON schema "
                                         f"object, got {type(schema).__name__} text")
            elif not isinstance(v, dict):
                raise ParameterError("structured_outputs.json must be a JSON schema (a dict "
                                     f"or its JSON text), got {type(v).__name__}")
        elif kind in ("regex", "grammar"):
            if not isinstance(v, str) or not v:
                raise ParameterError(f"structured_outputs.{kind} must be a non-empty str, got "
                                     f"{v!r:.60}")
        elif kind == "choice":
            if (isinstance(v, str) or not isinstance(v, (list, tuple)) or not v
                    or not all(isinstance(c, str) and c for c in v)):
                raise ParameterError("structured_outputs.choice must be a non-empty list of "
                                     f"non-empty strs, got {v!r:.60}")
            object.__setattr__(self, "choice", list(v))
        elif v is not True:
            raise ParameterError(f"structured_outputs.json_object must be True, got {v!r}")
        if not isinstance(self.disable_any_whitespace, bool):
            raise ParameterError("structured_outputs.disable_any_whitespace must be a bool, "
                                 f"got {self.disable_any_whitespace!r}")

    @property
    def kind(self) -> str:
        """The field that is set (one of :data:`KINDS`)."""
        return next(k for k in KINDS if getattr(self, k) is not None)

    def grammar_text(self) -> str:
        """The llguidance grammar of this constraint (``llguidance.grammar_from``)."""
        import llguidance

        kind = self.kind
        v = getattr(self, kind)
        if kind in ("json", "json_object"):  # as vLLM's guidance backend
            schema = _ANY_OBJECT if kind == "json_object" else v
            return llguidance.LLMatcher.grammar_from_json_schema(
                schema, defaults={"whitespace_flexible": not self.disable_any_whitespace})
        if kind == "choice":  # one regex lexeme: llguidance's parser takes at most ~2,000
            # alternatives in a grammar rule (a longer list failed at its second token)
            return llguidance.grammar_from("regex", "|".join(map(_literal, v)))
        return llguidance.grammar_from(_FORMATS[kind], v)


class GrammarError(ValueError):
    """A request's structured-outputs grammar is invalid for this model (the message says
    which field and why)."""


class GrammarMatchers:
    """The engine's structured-output state: llguidance's tokenizer of the model (built on
    first use: ~0.3 s for a 49k vocabulary, ~4 s for Gemma 3's 262k), each request's checked
    grammar and each sequence's matcher.

    Args:
      tokenizer: the engine's ``jaxinfer.tokenizer.Tokenizer`` (None: structured outputs
        are refused).
      vocab_size: the model's vocabulary (the logits' width; ids past the tokenizer's are
        never allowed).
      eos_token_ids: ids that end a sequence (allowed where the grammar may end).
      threads: threads that fill several rows' masks at once (llguidance's ``LLExecutor``,
        Rust threads without the GIL); None: its default (80 % of the CPUs, at most 32); 1:
        one row after the other on the calling thread. A row's mask takes microseconds
        where few tokens fit (a JSON key) and up to ~1 ms where most do (free text at a
        262k vocabulary: benchmarks/structured_outputs_cost.py).
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Iterable[int],
                 threads: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = [int(t) for t in eos_token_ids]
        self.words = (vocab_size + 31) // 32  # int32 words of a row's bitmask
        self.threads = threads
        self._executor: Any = None
        self._ll_tokenizer: Any = None
        self._lock = threading.Lock()  # the tokenizer's one build (add_request's threads)
        self._grammars: dict[int, str] = {}  # request id -> grammar text
        self._matchers: dict[Any, Any] = {}  # sequence key -> LLMatcher
        self._allowed: dict[int, np.ndarray] = {}  # request id -> allowed_token_ids' bits

    def ll_tokenizer(self) -> Any:
        """llguidance's ``LLTokenizer`` of the model (built once, on first use)."""
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance.hf

                t0 = time.perf_counter()
                self._ll_tokenizer = llguidance.hf.from_tokenizer(
                    self.tokenizer.hf, n_vocab=self.vocab_size,
                    eos_token=self.eos_token_ids or None)
                log.info("built llguidance's tokenizer (%d tokens) in %.2f s",
                         self.vocab_size, time.perf_counter() - t0)
            return self._ll_tokenizer

    def check(self, params: StructuredOutputsParams,
              allowed_token_ids: Iterable[int] | None = None) -> str:
        """``params``' llguidance grammar, checked against the model's tokenizer (for
        :meth:`add` once the request is queued).

        Raises:
          GrammarError: the model has no tokenizer, the grammar does not compile (the
            message is llguidance's, prefixed with the field), no output can match it, or
            none of the request's ``allowed_token_ids`` may start an output it matches.
        """
        import llguidance

        if self.tokenizer is None:
            raise GrammarError("structured_outputs need a tokenizer; this model has none")
        kind = params.kind
        try:
            grammar = params.grammar_text()
        except (ValueError, TypeError) as e:  # GBNF not convertible, a dict not JSON
            raise GrammarError(f"structured_outputs.{kind}: {e}") from None
        error = llguidance.LLMatcher.validate_grammar(grammar, self.ll_tokenizer())
        if not error:  # the first token's mask: a grammar that matches nothing, or one
            # too complex for the parser, fails there (validation does not see either)
            import llguidance.numpy as lnp

            m = llguidance.LLMatcher(self.ll_tokenizer(), grammar, log_level=0)
            first = np.zeros((1, self.words), np.int32)
            lnp.fill_next_token_bitmask(m, first, 0)
            if m.is_error():
                raise GrammarError(f"structured_outputs.{kind}: no output can match it "
                                   f"(llguidance: {_short_error(m.get_error())})")
            if allowed_token_ids and not (first[0] & token_bitmask(
                    [t for t in allowed_token_ids if t < 32 * self.words], self.words)).any():
                raise GrammarError(f"structured_outputs.{kind}: none of allowed_token_ids "
                                   "may start an output it matches")
        if error:
            raise GrammarError(f"structured_outputs.{kind} is not a valid {kind} for this "
                               f"model: {error.strip()}")
        return grammar

    def add(self, request_id: int, grammar: str) -> None:
        """Keep request ``request_id``'s grammar (from :meth:`check`) for its sequences."""
        self._grammars[request_id] = grammar

    def has(self, request_id: int) -> bool:
        return request_id in self._grammars

    @property
    def active(self) -> bool:
        """Whether some live request has structured outputs (else a step has no rows to
        mask, and the engine skips looking for them)."""
        return bool(self._grammars)

    def _matcher(self, seq: Any) -> Any:
        """The matcher of ``seq`` (a ``sequence.Sequence`` of a request :meth:`add` took),
        made on first use and fed the outputs it already has."""
        m = self._matchers.get(seq.key)
        if m is None:
            import llguidance

            m = llguidance.LLMatcher(self.ll_tokenizer(), self._grammars[seq.seq_id],
                                     log_level=0)
            if seq.output_token_ids and not m.consume_tokens(list(seq.output_token_ids)):
                log.warning("request %s: its outputs so far do not match its grammar: %s",
                            seq.seq_id, _short_error(m.get_error()))
            self._matchers[seq.key] = m
        return m

    def masks(self, seqs: Sequence[Any]) -> np.ndarray:
        """The next token's allowed set of each of ``seqs``: [len(seqs), W] int32 bitmasks
        (W = ceil(vocab_size / 32)); a sequence with ``allowed_token_ids`` keeps only those
        of them the grammar allows. A matcher in error (it was fed a token its grammar
        refused) allows every token: :meth:`accept` has finished its sequence."""
        import llguidance.numpy as lnp

        out = np.zeros((len(seqs), self.words), np.int32)
        live = []
        for i, seq in enumerate(seqs):
            m = self._matcher(seq)
            if m.is_error():
                out[i] = -1
            else:
                live.append((m, i))
        if len(live) > 1 and self.threads != 1:
            if self._executor is None:
                import llguidance

                self._executor = llguidance.LLExecutor(num_threads=self.threads)
            lnp.fill_next_token_bitmask_par(self._executor, live, out)
        else:
            for m, i in live:
                lnp.fill_next_token_bitmask(m, out, i)
        for i, seq in enumerate(seqs):
            allowed = seq.sampling_params.allowed_token_ids
            if allowed:  # packed once a request, not every step
                bits = self._allowed.get(seq.seq_id)
                if bits is None:
                    bits = self._allowed[seq.seq_id] = token_bitmask(allowed, self.words)
                out[i] &= bits
        return out

    def accept(self, seq: Any, token: int) -> str | None:
        """Feed ``seq``'s new output ``token`` to its matcher. Returns None while the output
        may go on; "stop" when the grammar is complete (no token may follow); "rejected"
        when the grammar refuses the token (its mask allowed nothing the other parameters
        allowed, e.g. only EOS while ``min_tokens`` masked it)."""
        m = self._matcher(seq)
        if not m.consume_token(int(token)):
            # a token the grammar refuses, or the grammar itself failing on it (llguidance
            # builds a regex lazily: `a{1000000}` passes check() and fails here, "lexer
            # error: too many expressions constructed")
            log.warning("request %s: its structured_outputs grammar ends the output at token "
                        "%d (finish_reason abort): %s", seq.seq_id, token,
                        _short_error(m.get_error()))
            return "rejected"
        return "stop" if m.is_stopped() else None

    def forced(self, seq: Any) -> list[int]:
        """The tokens ``seq``'s grammar forces next (llguidance's ``compute_ff_tokens``: the
        canonical tokens of the bytes every continuation starts with, less a last token a
        longer token could still extend), for jump-forward decoding (jaxinfer/jump_forward.py);
        [] when none is forced or the matcher is in error. The matcher is not advanced:
        :meth:`accept` each token that is used."""
        m = self._matcher(seq)
        return [] if m.is_error() else [int(t) for t in m.compute_ff_tokens()]

    def forget_sequence(self, key: Any) -> None:
        self._matchers.pop(key, None)

    def forget_request(self, request_id: int) -> None:
        self._grammars.pop(request_id, None)
        self._allowed.pop(request_id, None)


def token_bitmask(token_ids: Iterable[int], words: int) -> np.ndarray:
    """[words] int32 bitmask with the bits of ``token_ids`` set (bit t % 32 of word t // 32).
    Raises IndexError for an id past ``32 * words``."""
    bits = np.zeros(words * 32, bool)
    bits[np.asarray(list(token_ids), np.int64)] = True
    return np.packbits(bits, bitorder="little").view(np.int32)


def unpack_bitmask(mask: np.ndarray, vocab_size: int) -> np.ndarray:
    """[..., W] int32 bitmasks -> [..., vocab_size] bool (the inverse of :func:`token_bitmask`,
    the host twin of ``sampling_penalties.load_allowed_masks``)."""
    b = np.unpackbits(np.ascontiguousarray(mask).view(np.uint8), axis=-1, bitorder="little")
    return b[..., :vocab_size].astype(bool)
