"""Prompts to token ids, with the checks made before any work is spent on them.

A text prompt or a conversation that cannot fit ``max_model_len`` is refused from its length
alone (``Tokenizer.min_tokens``), before megabytes of it are encoded or rendered; token ids
are refused by count before they are read. ``LLMEngine.encode_prompt`` / ``encode_chat``,
``LLM.generate`` / ``chat``, ``jaxinfer chat`` and the gRPC servicer all come through here, so
each refusal has one wording (as vLLM's ``InputPreprocessor`` does for its entry points).
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any
from typing import Sequence as Seq

import numpy as np

from jaxinfer.sampling_params import SamplingParams
from jaxinfer.tokenizer import Tokenizer, check_messages, text_contents, utf8_problem


class RequestError(ValueError):
    """A request cannot be accepted (empty or too-long prompt, bad parameters)."""


class PromptTooLongError(RequestError):
    """The request cannot fit: its prompt (or prompt + ``max_tokens``) is longer than
    ``max_model_len``, or its KV pages exceed the whole pool. A shorter prompt fits; a chat
    front end can drop earlier turns."""


def check_text_fits(tokenizer: Tokenizer, texts: Seq[str], max_model_len: int) -> None:
    """Raise PromptTooLongError when ``texts`` (a prompt, or a conversation's message contents)
    encode to more than ``max_model_len`` tokens whatever they encode to
    (``Tokenizer.min_tokens``, from their length alone): the check to make before encoding."""
    if (n := tokenizer.min_tokens(*texts)) > max_model_len:
        raise PromptTooLongError(f"prompt has {sum(map(len, texts))} characters, so at least "
                                 f"{n} tokens; max_model_len is {max_model_len}")


def truncation(truncate_prompt_tokens: int | None, max_model_len: int) -> int | None:
    """How many prompt tokens ``SamplingParams.truncate_prompt_tokens`` keeps: None (no
    truncation), -1 -> ``max_model_len``, else the value. Raises RequestError above
    ``max_model_len`` (vLLM's ``_validate_truncation_size``)."""
    k = truncate_prompt_tokens
    if k is None:
        return None
    if (isinstance(k, (bool, np.bool_)) or not isinstance(k, numbers.Integral)
            or not (k == -1 or k >= 1)):
        raise RequestError(f"truncate_prompt_tokens must be None, -1 (max_model_len) or an "
                           f"int >= 1, got {k!r}")
    k = int(k)
    if k == -1:
        return max_model_len
    if k > max_model_len:
        raise RequestError(f"truncate_prompt_tokens ({k}) is greater than max_model_len "
                           f"({max_model_len})")
    return k


def encode_prompt(tokenizer: Tokenizer | None, prompt: str | Seq[int], max_model_len: int,
                  vocab_size: int, truncate: int | None = None) -> list[int]:
    """Token ids of a text prompt (the tokenizer's special tokens added) or ids as given;
    with ``truncate`` (a :func:`truncation` result), only the last ``truncate`` of them
    (a text keeps its special tokens: ``Tokenizer.encode``'s ``max_length``).

    Raises:
      RequestError: a prompt neither text nor a sequence of ids (bytes, None, a number),
        an empty prompt, text that is not valid UTF-8 (a lone surrogate), a text prompt
        without a tokenizer, ids outside
        ``[0, vocab_size)``, or a prompt longer than ``max_model_len`` -- checked before a
        text is encoded or ids are read one by one, so an oversized request is refused in
        microseconds (``LLMEngine.add_request`` also refuses exactly ``max_model_len``
        tokens: no room to generate).
    """
    if isinstance(prompt, str):
        if not prompt:
            raise RequestError("prompt is empty")
        if (why := utf8_problem(prompt)) is not None:
            raise RequestError(f"prompt {why}")
        if tokenizer is None:
            raise RequestError("this model has no tokenizer: pass prompt token ids (the "
                               "CLI's --token-ids, gRPC's prompt_token_ids)")
        if truncate is None:
            check_text_fits(tokenizer, (prompt,), max_model_len)
        return tokenizer.encode(prompt, max_length=truncate)
    if prompt is None or isinstance(prompt, (bytes, bytearray, memoryview, dict, set,
                                             frozenset, numbers.Number)):
        # bytes would read as the ids of their byte values
        raise RequestError(f"prompt must be a str or a sequence of token ids (ints), got "
                           f"{type(prompt).__name__}")
    if truncate is not None and hasattr(prompt, "__len__"):
        try:  # lists, ranges, arrays: the dropped ids are never read
            prompt = prompt[max(len(prompt) - truncate, 0):]  # type: ignore[index]
        except (TypeError, KeyError):
            pass  # not sliceable (a deque): truncated below, after reading
    if truncate is None and hasattr(prompt, "__len__") and len(prompt) > max_model_len:
        # (= limit passes: prompt_logits takes it)
        raise PromptTooLongError(f"prompt has {len(prompt)} tokens; max_model_len is "
                                 f"{max_model_len}")
    if hasattr(prompt, "__array__") and not isinstance(prompt, np.ndarray):
        try:  # a jax array (its elements would be 0-d arrays): as numpy
            prompt = np.asarray(prompt)
        except (TypeError, ValueError):
            pass  # read element by element below
    try:
        ids = list(prompt)
        if truncate is not None:
            ids = ids[max(len(ids) - truncate, 0):]
    except TypeError:
        raise RequestError(f"prompt must be a str or a sequence of token ids (ints), got "
                           f"{type(prompt).__name__}") from None
    if not ids:
        raise RequestError("prompt is empty")
    for i, t in enumerate(ids):
        if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)):
            # (1.5 and np.float64(1.0) were reported as out of range)
            many = (" (this call takes one prompt, not a list of prompts)"
                    if isinstance(t, (str, list, tuple, np.ndarray)) else "")
            raise RequestError(f"prompt token ids must be integers: id {i} is {t!r} "
                               f"({type(t).__name__}){many}")
        if not 0 <= t < vocab_size:
            raise RequestError(f"prompt token id {int(t)} is not in [0, {vocab_size})")
    return [int(t) for t in ids]


def fit_max_tokens(sp: SamplingParams, num_prompt: int, max_model_len: int
                   ) -> SamplingParams:
    """``sp`` with ``max_tokens`` (and ``min_tokens``) capped at the room ``max_model_len``
    leaves after a prompt of ``num_prompt`` tokens (``max_tokens=None``: all of it, vLLM's);
    ``sp`` itself when it fits or the prompt leaves no room (``add_request`` then refuses
    it). Used by ``LLM.generate`` (vLLM's offline LLM caps any max_tokens), the server for
    a model's default max_tokens, and ``jaxinfer chat``; before ``checked_params``, whose
    ``bad_words_token_ids`` a replaced copy would not keep."""
    room = max_model_len - num_prompt
    if room < 1 or sp.max_tokens is not None and sp.max_tokens <= room:
        return sp
    return dataclasses.replace(sp, max_tokens=room, min_tokens=min(sp.min_tokens, room))


def no_room_error(num_prompt: int, max_model_len: int,
                  truncate_prompt_tokens: int | None = None) -> PromptTooLongError:
    """The error for a prompt of ``max_model_len`` tokens or more (no token can be generated);
    with truncation asked for, it says how much truncation leaves room."""
    hint = (f"; truncate_prompt_tokens {truncate_prompt_tokens} keeps too many: at most "
            f"{max_model_len - 1} leave room" if truncate_prompt_tokens is not None else "")
    return PromptTooLongError(f"prompt has {num_prompt} tokens; max_model_len is "
                              f"{max_model_len} (at least one token must be generated){hint}")


def encode_chat(tokenizer: Tokenizer | None, messages: Any, max_model_len: int,
                add_generation_prompt: bool = True, truncate: int | None = None,
                **template: Any) -> list[int]:
    """:func:`chat_prompt`'s token ids (same arguments and errors)."""
    return chat_prompt(tokenizer, messages, max_model_len, add_generation_prompt, truncate,
                       **template)[1]


def chat_prompt(tokenizer: Tokenizer | None, messages: Any, max_model_len: int,
                add_generation_prompt: bool = True, truncate: int | None = None,
                **template: Any) -> tuple[str, list[int]]:
    """The rendered text and token ids of a conversation (``[{"role": ..., "content": ...},
    ...]``; a content may also be a list of text parts, ``tokenizer.text_contents``) rendered
    with the model's chat template (``Tokenizer.render_chat``, which takes the ``template``
    keywords: chat_template, continue_final_message, chat_template_kwargs), rendered once and
    encoded without special tokens (``Tokenizer.apply_chat_template``'s ids); with ``truncate`` (a
    :func:`truncation` result), only the last ``truncate`` ids (the text stays whole, as
    vLLM's ``RequestOutput.prompt``).

    Raises:
      RequestError: no tokenizer; contents that cannot fit ``max_model_len`` whatever they
        encode to (checked before the template renders them); an empty rendering.
      TokenizerError: malformed messages (naming the message and field), no chat template,
        or the template refusing the conversation.
    """
    if tokenizer is None:
        raise RequestError("this model has no tokenizer, so no chat template")
    messages = text_contents(messages)
    check_messages(messages)
    if truncate is None:
        check_text_fits(tokenizer, [m["content"] for m in messages
                                    if isinstance(m.get("content"), str)], max_model_len)
    text = tokenizer.render_chat(list(messages), add_generation_prompt=add_generation_prompt,
                                 **template)
    ids = tokenizer.encode(text, add_special_tokens=False)
    if not ids:
        raise RequestError("the rendered conversation is empty")
    return text, ids if truncate is None else ids[max(len(ids) - truncate, 0):]
