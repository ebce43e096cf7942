"""Streaming detokenization: generated ids to text deltas (split from jaxinfer/tokenizer.py)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jaxinfer.tokenizer import Tokenizer


class IncrementalDetokenizer:
    """Turns generated ids into text deltas for streaming.

    Follows vLLM's ``detokenize_incrementally``: it keeps a *prefix offset* and a *read offset*
    into the ids, decodes ``ids[prefix:read]`` and ``ids[prefix:]`` and emits the difference, so
    tokenizers whose decoding of a token depends on its left neighbour (SentencePiece spaces,
    byte-level pieces) give the same text as decoding everything at once. While the new text
    ends in U+FFFD (a UTF-8 character split over tokens) it emits nothing and waits.

    Args:
      tokenizer: the model's :class:`Tokenizer`.
      prompt_ids: the prompt; its last few tokens give the first delta its left context.
      skip_special_tokens: drop special tokens (EOS, turn markers) from the text.
    """

    INITIAL_OFFSET = 5  # vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (),
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = [int(t) for t in prompt_ids]
        self.prefix_offset = max(len(self.ids) - self.INITIAL_OFFSET, 0)
        self.read_offset = len(self.ids)
        self.output_text = ""

    def _decode(self, ids: Sequence[int]) -> str:
        # unchecked: ints >= 0 (the engine's tokens, a checked prompt's)
        return self.tokenizer.decode_ids(ids, self.skip_special_tokens)

    def step(self, new_ids: Iterable[int]) -> str:
        """Add generated ids; return the text they complete (possibly ``""``)."""
        out = []
        for t in new_ids:
            self.ids.append(int(t))
            prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
            new_text = self._decode(self.ids[self.prefix_offset:])
            if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
                out.append(new_text[len(prefix_text):])
                self.prefix_offset = self.read_offset
                self.read_offset = len(self.ids)
        delta = "".join(out)
        self.output_text += delta
        return delta

    def flush(self) -> str:
        """At the end of a stream: whatever was held back (e.g. a dangling partial character,
        emitted as U+FFFD)."""
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset:])
        delta = new_text[len(prefix_text):] if len(new_text) > len(prefix_text) else ""
        self.prefix_offset = self.read_offset = len(self.ids)
        self.output_text += delta
        return delta
