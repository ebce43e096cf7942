"""``LLM``, the offline batch facade over :class:`jaxinfer.engine.LLMEngine` (vLLM's ``LLM``):
``LLM(model, max_model_len=..., block_size=..., max_num_seqs=..., dtype=...)``,
``llm.generate(prompts, SamplingParams(...))``, ``llm.chat(messages, params)``; and
``iter_stream``, one request's outputs as the engine steps.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence as Seq

import numpy as np

from jaxinfer.engine import DEFAULT_MODEL, LLMEngine, RequestError
from jaxinfer.outputs import RequestOutput
from jaxinfer.sampling_params import ParameterError, SamplingParams


class LLM:
    """Offline batch generation (vLLM's ``LLM``).

    Args:
      model: see :class:`LLMEngine`. **engine_args: EngineConfig fields.
    """

    def __init__(self, model: Any = DEFAULT_MODEL, **engine_args: Any):
        self.engine = LLMEngine(model, **engine_args)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: str | Seq[str] | Seq[Seq[int]],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate for every prompt; returns one RequestOutput per prompt, in order.

        Prompts are texts or lists of token ids. Raises RequestError / ParameterError on bad
        input, naming the prompt's position in the batch; nothing of the batch stays queued
        (requests added before the bad one are aborted).
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], (int, np.integer))):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ParameterError(f"got {len(params)} sampling params for "
                                     f"{len(prompts)} prompts")
        encoded = [self.engine.encode_prompt(p) for p in prompts]  # validate all first
        ids: list[int] = []
        for i, (p, e, sp) in enumerate(zip(prompts, encoded, params)):
            try:  # the engine checks lengths and n against its limits here
                ids.append(self.engine.add_request(p, sp, prompt_token_ids=e))
            except ValueError as err:  # RequestError, ParameterError, the scheduler's
                for rid in ids:
                    self.engine.abort_request(rid)
                err.args = (f"prompt {i} of the batch: {err}", *err.args[1:])
                raise
        return self._run(ids, use_tqdm)

    def chat(self, messages: list[dict[str, str]] | list[list[dict[str, str]]],
             sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
             use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them (chat template applied)."""
        if self.tokenizer is None:
            raise RequestError("this model has no tokenizer, so no chat template")
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        ids = [self.tokenizer.apply_chat_template(list(c)) for c in convs]  # type: ignore
        return self.generate(ids, sampling_params, use_tqdm)

    def _run(self, ids: list[int], use_tqdm: bool) -> list[RequestOutput]:
        final: dict[int, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(ids), desc="requests", unit="req")
        pending = set(ids)
        while pending:
            for o in self.engine.step():
                if o.finished and o.request_id in pending:
                    final[o.request_id] = o
                    pending.discard(o.request_id)
                    if bar:
                        bar.update(1)
        if bar:
            bar.close()
        return [final[i] for i in ids]


def iter_stream(engine: LLMEngine, request_id: int) -> Iterable[RequestOutput]:
    """Step the engine and yield this request's outputs until it finishes."""
    while True:
        for o in engine.step():
            if o.request_id == request_id:
                yield o
                if o.finished:
                    return
