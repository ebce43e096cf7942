"""A request's sampling parameters checked against the model before it is queued
(``LLMEngine.add_request``): plain Python over the vocabulary size, the EOS ids and the
tokenizer (no device work; ``sampling_bad_words`` brings JAX in for its device mask).

What is refused here would otherwise fail later, inside a step, where the request cannot be
told: ids outside the vocabulary (the device tables index with them), stop strings without a
tokenizer to match them, and parameters that mask every token (argmax would then pick a
-inf token; vLLM samples garbage in that case, we refuse the request).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from jaxinfer.prompts import RequestError
from jaxinfer.sampling_bad_words import BadWordsError, encode_bad_words
from jaxinfer.sampling_params import ParameterError, SamplingParams


def checked_params(params: SamplingParams | None, tokenizer: Any, vocab_size: int,
                   eos_token_ids: Iterable[int]) -> SamplingParams:
    """The request's own copy of ``params`` (default ``SamplingParams()``), checked again (as
    vLLM v1 clones them: a caller that edits its SamplingParams later changes neither the
    request nor its checks), with ``bad_words_token_ids`` set from ``bad_words``
    (``sampling_bad_words.encode_bad_words``).

    Raises:
      RequestError: not a SamplingParams; a field the copy's checks refuse; stop strings or
        bad_words without a tokenizer; ``stop_token_ids`` / ``allowed_token_ids`` /
        ``logit_bias`` ids >= ``vocab_size``; parameters under which no token could be
        sampled (:func:`no_token_left`).
    """
    params = params or SamplingParams()
    if not isinstance(params, SamplingParams):
        raise RequestError(f"sampling params must be SamplingParams, got {type(params)}")
    try:
        params = dataclasses.replace(params)
    except (ParameterError, TypeError) as e:
        raise RequestError(f"sampling params: {e}") from e
    if params.stop_strings and tokenizer is None:
        raise RequestError("stop strings need a tokenizer; this model has none "
                           "(use stop_token_ids)")
    if params.bad_words:
        try:
            params.bad_words_token_ids = encode_bad_words(tokenizer, params.bad_words,
                                                          vocab_size)
        except BadWordsError as e:
            raise RequestError(str(e)) from e
    V = vocab_size
    for name in ("stop_token_ids", "allowed_token_ids", "logit_bias"):
        if outside := [t for t in getattr(params, name) or () if t >= V]:
            raise RequestError(f"{name} {outside[:8]} are not in the vocabulary: ids must "
                               f"be in [0, {V}) (vocab size {V})")
    if (why := no_token_left(params, vocab_size, eos_token_ids)) is not None:
        raise RequestError(why)
    return params


def masked_stops(sp: SamplingParams, vocab_size: int,
                 eos_token_ids: Iterable[int]) -> set[int]:
    """The token ids masked before ``sp.min_tokens`` outputs: what the scheduler stops on
    (``eos_token_ids`` unless ``ignore_eos``, ``stop_token_ids``) within the vocabulary;
    none without ``min_tokens``."""
    if sp.min_tokens == 0:
        return set()
    eos = () if sp.ignore_eos else eos_token_ids
    return {t for t in (*sp.stop_token_ids, *eos) if t < vocab_size}


def no_token_left(sp: SamplingParams, vocab_size: int,
                  eos_token_ids: Iterable[int]) -> str | None:
    """Why every token would be masked, or None: the always-banned one-token ``bad_words``
    cover ``allowed_token_ids`` (or the vocabulary), or do so with EOS and the stop ids
    before ``min_tokens``."""
    V, allowed = vocab_size, sp.allowed_token_ids
    banned = {s[0] for s in sp.bad_words_token_ids or () if len(s) == 1}
    stops = masked_stops(sp, vocab_size, eos_token_ids)
    what = "allowed_token_ids" if allowed else f"the whole vocabulary ({V} ids)"

    def covers(ids: set[int]) -> bool:
        return bool(ids) and (len(ids) >= V or bool(allowed) and ids.issuperset(allowed))

    if covers(banned):
        return f"bad_words ban {what}, so no token could be sampled"
    if covers(stops | banned):
        return (f"min_tokens {sp.min_tokens}: EOS and stop_token_ids"
                f"{' and bad_words' if banned else ''} cover {what}, so no token could "
                f"be sampled before then")
    return None
