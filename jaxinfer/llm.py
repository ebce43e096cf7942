"""``LLM``, the offline batch facade over :class:`jaxinfer.engine.LLMEngine` (vLLM's ``LLM``):
``LLM(model, max_model_len=..., block_size=..., max_num_seqs=..., dtype=...)``,
``llm.generate(prompts, SamplingParams(...))``, ``llm.chat(messages, params)``; and
``iter_stream``, one request's outputs as the engine steps.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterable
from typing import Sequence as Seq

import numpy as np

from jaxinfer.engine import DEFAULT_MODEL, LLMEngine, RequestError
from jaxinfer.outputs import RequestOutput
from jaxinfer.prompts import fit_max_tokens
from jaxinfer.sampling_params import ParameterError, SamplingParams, with_output_kind


def _truncation_of(sampling_params: Any, i: int) -> int | None:
    """``truncate_prompt_tokens`` of the params of prompt ``i`` (one SamplingParams for all,
    or a list); None where there are none (``generate`` then refuses what is wrong)."""
    sp = sampling_params
    if isinstance(sp, (list, tuple)):
        sp = sp[i] if i < len(sp) else None
    return sp.truncate_prompt_tokens if isinstance(sp, SamplingParams) else None


class LLM:
    """Offline batch generation (vLLM's ``LLM``).

    Args:
      model: see :class:`LLMEngine`. **engine_args: EngineConfig fields.
    """

    def __init__(self, model: Any = DEFAULT_MODEL, **engine_args: Any):
        self.engine = LLMEngine(model, **engine_args)
        # generate / chat from several threads run one at a time: each steps the engine
        # until its own requests finish (two at once failed inside XLA, "buffer donated")
        self._lock = threading.RLock()

    @property
    def tokenizer(self):
        """The engine's ``jaxinfer.tokenizer.Tokenizer`` (None for a model without one)."""
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's ``LLM.get_default_sampling_params()``: what :meth:`generate` and
        :meth:`chat` run without ``sampling_params`` — the checkpoint's
        ``generation_config.json`` defaults over SamplingParams' own, unless the LLM was
        made with ``generation_config="vllm"`` (``LLMEngine.default_sampling_params``)."""
        return self.engine.default_sampling_params()

    def get_tokenizer(self):
        """vLLM's ``LLM.get_tokenizer()``: the transformers tokenizer behind
        :attr:`tokenizer` (``Tokenizer.hf``), or None for a model without one."""
        return None if self.tokenizer is None else self.tokenizer.hf

    def generate(self, prompts: str | Seq[str] | Seq[Seq[int]],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate for every prompt; returns one RequestOutput per prompt, in order.

        Prompts are texts or lists of token ids (``prompts`` may be one of either), or vLLM's
        ``{"prompt": text}`` / ``{"prompt_token_ids": ids}`` dicts (:func:`prompt_batch`). Raises
        RequestError / ParameterError on bad input, naming the prompt's position in the batch;
        nothing of the batch stays queued (requests added before the bad one are aborted).
        An exception while the batch runs (KeyboardInterrupt included) aborts its unfinished
        requests before it propagates: none keeps KV pages or runs in a later call.
        ``sampling_params`` is one SamplingParams for all prompts or a list, one per prompt;
        None: :meth:`get_default_sampling_params` (the model's generation-config defaults).
        Calls from several threads run one after another (vLLM's ``LLM`` is not thread-safe).
        A prompt whose ``max_tokens`` would pass ``max_model_len`` generates up to
        ``max_model_len`` and finishes with "length", as vLLM's offline ``LLM`` (the engine's
        ``add_request`` and the server refuse it, as vLLM's OpenAI server).
        """
        with self._lock:
            return self._generate(prompts, sampling_params, use_tqdm)

    def _generate(self, prompts: Any, sampling_params: Any, use_tqdm: bool
                  ) -> list[RequestOutput]:
        prompts = prompt_batch(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or self.get_default_sampling_params()] * len(prompts)
        elif isinstance(sampling_params, (list, tuple)):
            params = list(sampling_params)
            for i, sp in enumerate(params):
                if not isinstance(sp, SamplingParams):
                    raise ParameterError(f"sampling_params[{i}] must be SamplingParams, got "
                                         f"{type(sp).__name__}")
            if len(params) != len(prompts):
                raise ParameterError(f"got {len(params)} sampling params for "
                                     f"{len(prompts)} prompts")
        else:  # vLLM takes no dict either: SamplingParams(**d) says which field is wrong
            raise ParameterError(f"sampling_params must be SamplingParams or a list of them "
                                 f"(one per prompt), got {type(sampling_params).__name__}")
        # One output per request, at its end (vLLM's LLM.generate sets FINAL_ONLY too): no
        # per-step copies of every row's tokens and text.
        params = with_output_kind(params, "final_only")
        encoded = []
        for i, p in enumerate(prompts):  # validate all before queueing any
            try:
                encoded.append(self.engine.encode_prompt(p, params[i].truncate_prompt_tokens))
            except ValueError as err:
                err.args = (f"prompt {i} of the batch: {err}", *err.args[1:])
                raise
        limit = self.engine.config.max_model_len
        params = [fit_max_tokens(sp, len(e), limit) for e, sp in zip(encoded, params)]
        ids: list[int] = []
        for i, (p, e, sp) in enumerate(zip(prompts, encoded, params)):
            try:  # the engine checks lengths and n against its limits here
                ids.append(self.engine.add_request(p, sp, prompt_token_ids=e))
            except BaseException as err:  # RequestError, ParameterError, the scheduler's;
                for rid in ids:  # an interrupt too: nothing of the batch stays queued
                    self.engine.abort_request(rid)
                if isinstance(err, ValueError):
                    err.args = (f"prompt {i} of the batch: {err}", *err.args[1:])
                raise
        return self._run(ids, use_tqdm)

    def chat(self, messages: list[dict[str, str]] | list[list[dict[str, str]]],
             sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
             use_tqdm: bool = False, *, chat_template: str | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them (chat template applied).

        The keywords are vLLM ``LLM.chat``'s: ``chat_template`` a Jinja template used
        instead of the model's; ``add_generation_prompt`` (default True) opens the
        assistant's turn; ``continue_final_message`` continues the last (assistant) message
        instead (set ``add_generation_prompt=False``); ``chat_template_kwargs`` extra
        template variables (Qwen3: ``{"enable_thinking": False}``). Each output's ``prompt``
        is the rendered conversation (before any ``truncate_prompt_tokens``), as vLLM's.
        Raises RequestError / TokenizerError (ValueErrors) naming the conversation.
        """
        template = dict(add_generation_prompt=add_generation_prompt, chat_template=chat_template,
                        continue_final_message=continue_final_message,
                        chat_template_kwargs=chat_template_kwargs)
        if self.tokenizer is None:
            raise RequestError("this model has no tokenizer, so no chat template")
        if not isinstance(messages, (list, tuple)) or not messages:
            raise RequestError(f"messages must be a non-empty list of message dicts (one "
                               f"conversation) or a list of such lists, got {_short(messages)}")
        convs = [list(messages)] if isinstance(messages[0], dict) else messages
        rendered = []  # (text, ids) of each conversation, each rendered once
        for i, conv in enumerate(convs):
            try:  # a conversation that cannot fit is refused before it is rendered
                rendered.append(self.engine.chat_prompt(  # type: ignore[arg-type]
                    conv, truncate_prompt_tokens=_truncation_of(sampling_params, i),
                    **template))
            except ValueError as err:  # which conversation, which message and why
                if convs is messages:  # a list of conversations (not one)
                    err.args = (f"conversation {i}: {err}", *err.args[1:])
                raise
        outs = self.generate([ids for _, ids in rendered], sampling_params, use_tqdm)
        for out, (text, _) in zip(outs, rendered):  # vLLM's RequestOutput.prompt
            out.prompt = text
        return outs

    def _run(self, ids: list[int], use_tqdm: bool) -> list[RequestOutput]:
        final: dict[int, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(ids), desc="requests", unit="req")
        pending = set(ids)
        try:
            while pending:
                for o in self.engine.step():
                    if o.finished and o.request_id in pending:
                        final[o.request_id] = o
                        pending.discard(o.request_id)
                        if bar:
                            bar.update(1)
        except BaseException:  # KeyboardInterrupt included: the batch's requests go too,
            for rid in pending:  # so that they hold no KV pages nor run in the next call
                with contextlib.suppress(Exception):  # the error raised below is the news
                    self.engine.abort_request(rid)
            raise
        finally:
            if bar:
                bar.close()
        return [final[i] for i in ids]


def _short(v: object) -> str:
    """``v`` for a message: its type and repr, cut at 40 characters."""
    return f"{type(v).__name__} {v!r:.40}"


def _is_token_id(t: object) -> bool:
    return isinstance(t, (int, np.integer)) and not isinstance(t, bool)


def prompt_batch(prompts: Any) -> list[str | Seq[int]]:
    """``LLM.generate``'s ``prompts`` as a list of prompts, each a str or a 1-D sequence of
    ints (a str, a list of ints or a 1-D array is one prompt; a 2-D array is one per row).
    vLLM's dict forms are taken too (``{"prompt": str}``, its TextPrompt, and
    ``{"prompt_token_ids": [...]}``, its TokensPrompt), alone or in a list. Token ids are
    checked against the vocabulary later, by the engine.

    Raises:
      RequestError: ``prompts`` or one prompt of another type (None, a number, nested
        lists, a text among token ids), or a dict with other keys (vLLM's multi-modal or
        embedding inputs are not supported), naming the prompt's position.
    """
    forms = "a str, a list of token ids (ints), or a list of those"
    if isinstance(prompts, (str, dict)):
        prompts = [prompts]
    if isinstance(prompts, np.ndarray) and prompts.ndim in (1, 2):
        return [prompts] if prompts.ndim == 1 else list(prompts)
    if not isinstance(prompts, (list, tuple)):
        raise RequestError(f"prompts must be {forms}, got {_short(prompts)}")
    batch = [prompts] if prompts and _is_token_id(prompts[0]) else list(prompts)
    for i, p in enumerate(batch):
        if isinstance(p, dict):
            batch[i] = p = _dict_prompt(i, p)
        if isinstance(p, str):
            continue
        if not (isinstance(p, (list, tuple)) or (isinstance(p, np.ndarray) and p.ndim == 1)):
            raise RequestError(f"prompt {i} of the batch must be a str or a list of token ids "
                               f"(ints), got {_short(p)}")
        for j, t in enumerate(p):
            if not _is_token_id(t):
                raise RequestError(
                    f"prompt {i} of the batch: token {j} is {_short(t)}, not an int token id"
                    + (" (texts and token-id lists are separate prompts: [[1, 2], 'text'])"
                       if isinstance(t, str) else ""))
    return batch


def _dict_prompt(i: int, p: dict) -> Any:
    """The text or token ids of vLLM's TextPrompt ``{"prompt": ...}`` or TokensPrompt
    ``{"prompt_token_ids": [...]}`` (prompt ``i`` of the batch); RequestError otherwise."""
    keys = set(p)
    if keys == {"prompt"} or keys == {"prompt_token_ids"}:
        return p["prompt" if "prompt" in keys else "prompt_token_ids"]
    raise RequestError(f"prompt {i} of the batch is a dict with keys {sorted(map(str, keys))}: "
                       f"only {{'prompt': text}} or {{'prompt_token_ids': [ids]}} are taken "
                       f"(vLLM's TextPrompt / TokensPrompt; multi-modal and embedding inputs "
                       f"are not supported)")


def iter_stream(engine: LLMEngine, request_id: int) -> Iterable[RequestOutput]:
    """Step the engine and yield this request's outputs until it finishes."""
    while True:
        for o in engine.step():
            if o.request_id == request_id:
                yield o
                if o.finished:
                    return
