"""``LLMEngine``: add_request / abort / step over the scheduler and the compiled programs
(the offline facade ``LLM`` is in jaxinfer/llm.py).

Names and behaviour follow vLLM so users can move over: ``LLMEngine(model, max_model_len=...,
block_size=..., max_num_seqs=..., dtype=...)``, ``engine.add_request(prompt, SamplingParams(...))``,
``engine.step()``.
"""

from __future__ import annotations

import itertools
import logging
import numbers
import os
import time
from typing import Any, NamedTuple
from typing import Sequence as Seq

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxinfer import engine_logits, engine_outputs, engine_slots, kv_pages_memo, prompts
from jaxinfer.batch import SlotTable, StepInputs, build_step
from jaxinfer.config import ConfigError, ModelConfig
from jaxinfer.engine_async import plan_next_decode
from jaxinfer.engine_config import _resolve_dtype, check_engine_args, engine_config_for
from jaxinfer.engine_multi import Window, launch_next_window, launch_window
from jaxinfer.input_batch import InputBatch
from jaxinfer.kv_sizing import size_for_engine
from jaxinfer.layers.attention import get_backend
from jaxinfer.models.params import fp8_names
from jaxinfer.models.transformer import CausalLM, model_options
from jaxinfer.outputs import (
    RequestOutput,
    RequestStates,
)
from jaxinfer.prompts import PromptTooLongError, RequestError
from jaxinfer.request_checks import checked_params
from jaxinfer.runner import ModelRunner, SampleResult
from jaxinfer.runner_multi import MultiStepPrograms
from jaxinfer.sampling_defaults import (
    GENERATION_CONFIG_MODES,
    check_sampling_defaults,
    default_sampling_params,
)
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.scheduler import (
    QueueFullError,
    RequestTooLongError,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)
from jaxinfer.sequence import Sequence
from jaxinfer.structured_outputs import GrammarError, GrammarMatchers

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m"


class _Launched(NamedTuple):
    """A dispatched sample step: its plan, host inputs and device output (not read yet)."""

    out: SchedulerOutput
    inputs: StepInputs
    result: Any  # sampling.SampleOutput on the device


class LLMEngine:
    """Continuous-batching engine over one model.

    Args:
      model: named model (``smollm2-135m``, ``gemma3-270m``), GGUF file, HF directory,
        converted orbax directory or ``dummy:<shape>`` (str or os.PathLike); or a ``LoadedModel``.
      compile_cache_dir: a directory written by ``jaxinfer compile`` for this configuration:
        programs are loaded from it instead of compiled (see jaxinfer/compile.py).
      compile_cache_strict: refuse (CompileCacheError) a compile cache that does not match
        instead of warning and compiling.
      generation_config: ``"auto"`` (default, vLLM's): requests without sampling params, and
        a served request's unset fields, take the defaults of the checkpoint's
        ``generation_config.json`` (temperature, top_k, top_p, min_p, repetition_penalty,
        max_new_tokens; jaxinfer/sampling_defaults.py); ``"vllm"``: SamplingParams' own.
      **engine_args: fields of :class:`EngineConfig` (max_model_len, block_size, ...).
    Raises:
      CheckpointError: the model cannot be found or read, or (``generation_config="auto"``)
        its generation_config.json holds a default SamplingParams refuses.
      ConfigError: bad engine options, an unknown option (named, with the closest field) or
        a model of the wrong type.
    """

    def __init__(self, model: Any = DEFAULT_MODEL, compile_cache_dir: str | None = None,
                 compile_cache_strict: bool = False, generation_config: str = "auto",
                 **engine_args: Any):
        t0 = time.perf_counter()
        from jaxinfer.compile_cache import kernel_env

        kernel_env()  # a bad $JAXINFER_* kernel switch fails here, before any loading
        if generation_config not in GENERATION_CONFIG_MODES:
            raise ConfigError(f"generation_config must be 'auto' (the checkpoint's "
                              f"generation_config.json defaults) or 'vllm' (SamplingParams' "
                              f"defaults), got {generation_config!r}")
        check_engine_args(model, engine_args)  # so do a wrong model type and unknown options
        if isinstance(model, os.PathLike):
            model = os.fspath(model)
        host_dtype = jnp.dtype(_resolve_dtype(engine_args.get("dtype", "auto"))).name
        # A LoadedModel (config, params, tokenizer) may be passed directly (research, tests).
        if isinstance(model, str):
            from jaxinfer.loading import load_model  # gguf / transformers: import on demand

            quant = "fp8" if engine_args.get("quantization") == "fp8" else None  # else ConfigError
            loaded = load_model(model, dtype=host_dtype, quantization=quant)
        else:
            loaded = model
        if fp8_names(loaded.params) and engine_args.get("quantization") is None:
            engine_args = {**engine_args, "quantization": "fp8"}  # an FP8 checkpoint runs FP8
        self.model_name = model if isinstance(model, str) else loaded.source
        self.model_config: ModelConfig = loaded.config
        self.tokenizer = loaded.tokenizer
        # The fields a request without them takes (vLLM's get_diff_sampling_param)
        self.sampling_defaults: dict[str, Any] = (
            dict(loaded.config.sampling_defaults) if generation_config == "auto" else {})
        check_sampling_defaults(self.sampling_defaults, loaded.source)
        self.load_seconds = time.perf_counter() - t0
        t1 = time.perf_counter()
        if compile_cache_dir is not None and engine_args.get("num_kv_pages") is None:
            from jaxinfer.compile import cached_num_kv_pages

            # A compile cache fixes the pool's shape (``jaxinfer compile --num-kv-pages``,
            # default max_num_seqs full-length sequences): adopt it rather than sizing from
            # free memory, which would give another shape (and skip the activation probe).
            pages = cached_num_kv_pages(compile_cache_dir)
            if pages is not None:
                engine_args = {**engine_args, "num_kv_pages": pages}
        self.config = engine_config_for(self.model_config, engine_args)
        cfg, ec = self.model_config, self.config
        self.dtype = _resolve_dtype(ec.dtype)
        net = CausalLM(cfg, loaded.params, self.dtype, **model_options(ec))
        del loaded
        jax.block_until_ready(nnx.state(net))
        t2 = time.perf_counter()
        self.kv_sizing = size_for_engine(net, cfg, ec, self.dtype)  # pages from memory
        # the same count on every start where the XLA cache keeps the programs
        self.kv_sizing = kv_pages_memo.stabilize(self.kv_sizing, cfg, ec)
        self.runner = ModelRunner(net, num_pages=self.kv_sizing.num_pages,
                                  page_size=ec.block_size,
                                  attention=get_backend(ec.attention_backend),
                                  kv_dtype=self.kv_sizing.kv_dtype, num_slots=ec.max_num_seqs)
        jax.block_until_ready(self.runner.cache)
        t3 = time.perf_counter()
        if compile_cache_dir is not None:
            from jaxinfer.compile import attach_program_store

            attach_program_store(self, compile_cache_dir, compile_cache_strict)
        # Start-up phases in seconds (``jaxinfer bench`` records them; issue #5 reports the
        # warm start without reading the weights): reading or generating the weights on the
        # host, moving them to the device (dtype cast, FP8 quantization on load, fused
        # projections), sizing and allocating the KV pool, opening the compile cache.
        self.start_seconds = {"read_weights": self.load_seconds, "weights_to_device": t2 - t1,
                              "kv_pool": t3 - t2, "compile_cache_open": time.perf_counter() - t3}
        eos = set(cfg.eos_token_ids)
        if self.tokenizer is not None:
            eos |= set(self.tokenizer.eos_token_ids)
        self.scheduler = Scheduler(SchedulerConfig.from_engine_config(
            ec, eos_token_ids=tuple(sorted(eos)), num_pages=self.kv_sizing.num_pages))
        self.structured = GrammarMatchers(self.tokenizer, cfg.vocab_size, sorted(eos))
        self._ids = itertools.count()
        self._seed_rng = np.random.default_rng(ec.seed)
        self._seeds: dict[int, int] = {}
        self._prompts: dict[int, str | None] = {}
        self._states: dict[int, RequestStates] = {}  # per sample: text, stop strings, logprobs
        self._slots = SlotTable(ec.max_num_seqs)  # penalty-state rows of running requests
        self._rows = InputBatch(self._slots, page_size=ec.block_size,
                                max_pages=ec.page_buckets[-1])  # decode steps' host rows
        self._first_token_time: dict[int, float] = {}
        # async scheduling: the step (or multi-step window) in flight
        self._pending: _Launched | Window | None = None
        self.num_pipelined_steps = 0  # steps dispatched before the previous was read
        self.num_jump_forward_tokens = 0  # forced tokens appended unsampled (jump_forward)
        self.multi_step_programs = MultiStepPrograms(self.runner)  # num_scheduler_steps > 1
        self.num_multi_steps = 0  # multi-step windows run
        self.num_one_step_windows = 0  # windows run as one step while their program builds
        self.num_pipelined_windows = 0  # windows dispatched before the previous was read
        log.info("engine ready: %s, dtype %s; %s", model, jnp.dtype(self.dtype).name,
                 self.kv_sizing.describe(ec.max_model_len))
        if self.sampling_defaults:  # as vLLM says it
            log.warning("default sampling parameters come from the model's "
                        "generation_config.json (GGUF: general.sampling.*): %s "
                        "(generation_config='vllm' ignores them)",
                        self.sampling_defaults)

    # ------------------------------------------------------------------ requests
    def encode_prompt(self, prompt: str | Seq[int],
                      truncate_prompt_tokens: int | None = None) -> list[int]:
        """Token ids of a text prompt (special tokens added) or ids as given; a prompt that
        cannot fit ``max_model_len`` is refused before it is encoded or read
        (:func:`jaxinfer.prompts.encode_prompt`). ``truncate_prompt_tokens``: as
        ``SamplingParams``' (keep the last k tokens; -1: max_model_len). Raises RequestError
        (TokenizerError, a ValueError, for a truncation that leaves no text token)."""
        limit = self.config.max_model_len
        return prompts.encode_prompt(self.tokenizer, prompt, limit, self.model_config.vocab_size,
                                     prompts.truncation(truncate_prompt_tokens, limit))

    def encode_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True,
                    truncate_prompt_tokens: int | None = None, **template: Any) -> list[int]:
        """Token ids of a conversation rendered with the chat template; one that cannot fit
        ``max_model_len`` is refused before rendering (:func:`jaxinfer.prompts.encode_chat`).
        ``truncate_prompt_tokens``: as ``SamplingParams``' (the rendering's last k ids);
        ``template``: ``Tokenizer.apply_chat_template``'s chat_template,
        continue_final_message, chat_template_kwargs.
        Raises RequestError or TokenizerError (both ValueError)."""
        return self.chat_prompt(messages, add_generation_prompt, truncate_prompt_tokens,
                                **template)[1]

    def chat_prompt(self, messages: list[dict[str, str]], add_generation_prompt: bool = True,
                    truncate_prompt_tokens: int | None = None, **template: Any
                    ) -> tuple[str, list[int]]:
        """:meth:`encode_chat` with the rendered text: (text, token ids), rendered once
        (:func:`jaxinfer.prompts.chat_prompt`); same arguments and errors."""
        limit = self.config.max_model_len
        return prompts.chat_prompt(self.tokenizer, messages, limit, add_generation_prompt,
                                   prompts.truncation(truncate_prompt_tokens, limit), **template)

    def default_sampling_params(self) -> SamplingParams:
        """What a request without sampling params runs with: the checkpoint's
        generation-config defaults (:attr:`sampling_defaults`) over SamplingParams' own
        (vLLM's ``LLM.get_default_sampling_params``); a new object each call."""
        return default_sampling_params(self.sampling_defaults)

    def add_request(self, prompt: str | Seq[int], params: SamplingParams | None = None,
                    request_id: int | None = None,
                    prompt_token_ids: list[int] | None = None) -> int:
        """Queue a request; returns its id. Raises RequestError on bad input (its subclass
        PromptTooLongError where prompt + max_tokens cannot fit max_model_len or the KV
        pool), and ``scheduler.QueueFullError`` (a ValueError) when ``max_queue_len`` requests are
        already waiting (nothing queued in either case).

        ``prompt_token_ids``, when given, are the already-encoded ``prompt`` (truncated
        already: ``params.truncate_prompt_tokens`` applies to ``prompt`` only). ``request_id``:
        an int >= 0 not in use by a live request (default: the next free automatic id).
        ``params`` None: :meth:`default_sampling_params`, its ``max_tokens`` capped at the
        room ``max_model_len`` leaves after the prompt.
        """
        defaulted = params is None
        params = checked_params(self.default_sampling_params() if defaulted else params,
                                self.tokenizer, self.model_config.vocab_size,
                                self.scheduler.cfg.eos_token_ids)
        ids = (prompt_token_ids if prompt_token_ids is not None
               else self.encode_prompt(prompt, params.truncate_prompt_tokens))
        limit = self.config.max_model_len
        if len(ids) >= limit:
            raise prompts.no_room_error(len(ids), limit, params.truncate_prompt_tokens)
        if params.max_tokens is None or defaulted and params.max_tokens > limit - len(ids):
            # vLLM: as many as fit (params is the request's copy); a model's max_new_tokens
            # default is capped there too (vLLM's OpenAI server), an explicit one refused.
            # In place, not prompts.fit_max_tokens: a replaced copy would drop the
            # bad_words_token_ids that checked_params set (not a dataclass field)
            params.max_tokens = limit - len(ids)
            params.min_tokens = min(params.min_tokens, params.max_tokens)
        rid = self._request_id(request_id)
        grammar = None
        if params.structured_outputs is not None:
            try:
                grammar = self.structured.check(params.structured_outputs,
                                                params.allowed_token_ids)
            except GrammarError as e:
                raise RequestError(str(e)) from e
        seq = Sequence(rid, ids, params)
        try:
            self.scheduler.add(seq)
        except ValueError as e:  # the scheduler's "request <id>: ..." without an id the
            # caller never got (an automatic one)
            msg = str(e) if request_id is not None else str(e).removeprefix(f"request {rid}: ")
            if isinstance(e, QueueFullError):  # overload, not bad input: max_queue_len
                e.args = (msg, *e.args[1:])
                raise
            raise (PromptTooLongError if isinstance(e, RequestTooLongError)
                   else RequestError)(msg) from e
        self._seeds[rid] = (params.seed if params.seed is not None
                            else int(self._seed_rng.integers(0, 2**63)))
        self._prompts[rid] = prompt if isinstance(prompt, str) else None
        self._states[rid] = RequestStates(params, ids, self.tokenizer)
        if grammar is not None:
            self.structured.add(rid, grammar)
        return rid

    def _request_id(self, request_id: Any) -> int:
        """``request_id`` checked (an int not in use), or the next free automatic id."""
        if request_id is None:
            rid = next(self._ids)
            while rid in self._states:  # taken by a caller's own id
                rid = next(self._ids)
            return rid
        if (isinstance(request_id, (bool, np.bool_))
                or not isinstance(request_id, numbers.Integral) or request_id < 0):
            raise RequestError(f"request_id must be an int >= 0, got {request_id!r}")
        if int(request_id) in self._states:
            raise RequestError(f"request_id {request_id} is already in use")
        return int(request_id)

    def abort_request(self, request_id: int) -> bool:
        """Abort a waiting or running request; its pages are freed at once."""
        seq = self.scheduler.abort(request_id)
        if seq is None:
            return False
        self._forget(request_id)
        self._drop_stale_pending()
        return True

    def _drop_stale_pending(self) -> None:
        """Forget the step or window in flight once no request is left (its rows all finished
        or were aborted): reading it back would only cost the next ``step`` call."""
        if self._pending is not None and not self.scheduler.has_unfinished:
            self._pending = None

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished

    def _forget(self, rid: int) -> None:
        self._seeds.pop(rid, None)
        self._prompts.pop(rid, None)
        self._first_token_time.pop(rid, None)
        st = self._states.pop(rid, None)
        for i in range(len(st.samples) if st is not None else 1):
            self._slots.release((rid, i))
            self.structured.forget_sequence((rid, i))
        self.structured.forget_request(rid)

    def _finished(self, seq: Sequence) -> None:
        """Drop a finished sample's slot, and the request's state once all its samples are
        done."""
        self._slots.release(seq.key)
        self.structured.forget_sequence(seq.key)
        if seq.group.is_finished:
            self._forget(seq.seq_id)

    # ------------------------------------------------------------------ stepping
    def _inputs(self, chunks, is_prefill: bool, token_on_device: bool = False):
        ec = self.config
        if not is_prefill:  # vectorized from per-slot rows; None: build it row by row
            inputs = self._rows.build_decode(chunks, seq_buckets=ec.decode_buckets,
                                             page_buckets=ec.page_buckets,
                                             request_seeds=self._seeds,
                                             token_on_device=token_on_device)
            if inputs is not None or token_on_device:  # no row-by-row path for the latter
                return inputs
        return build_step(chunks, is_prefill=is_prefill, page_size=ec.block_size,
                          token_buckets=ec.prefill_buckets if is_prefill else ec.decode_buckets,
                          seq_buckets=ec.prefill_seq_buckets if is_prefill
                          else ec.decode_buckets,
                          page_buckets=ec.page_buckets, request_seeds=self._seeds,
                          slots=self._slots.mapping)

    def step(self) -> list[RequestOutput]:
        """Run one scheduled step; returns outputs of requests that advanced or finished.

        With ``async_scheduling`` the step may already be in flight (dispatched by the last
        call), and the next decode step is dispatched before this one's tokens are read
        back (see engine_async.py); the outputs are those of the synchronous engine.
        """
        outs = self._step()
        self._drop_stale_pending()
        return outs

    def _step(self) -> list[RequestOutput]:
        ec = self.config
        cur, self._pending = self._pending, None
        if cur is None:
            out = self.scheduler.schedule()
            if out.is_empty:
                return []
            masks = engine_slots.prepare_device(self, out)  # structured outputs' masks
            if ec.num_scheduler_steps > 1:  # k decode steps in one program (engine_multi.py)
                cur = launch_window(self, out)  # (never with structured rows)
            if cur is None:
                inputs = self._inputs(out.chunks, out.is_prefill)
                if not ec.async_scheduling:
                    return self._collect(out, self.runner.execute(inputs, before_sample=masks))
                cur = self._launch(out, inputs, before_sample=masks)
        if isinstance(cur, Window):
            if ec.async_scheduling:
                self._pending = launch_next_window(self, cur)
            return self._collect_steps([(s, SampleResult(t))
                                        for s, t in zip(cur.steps, cur.fetch())])
        if ec.num_scheduler_steps == 1:  # with k > 1, windows pipeline instead
            self._pending = self._launch_next(cur)
        want_logprobs = bool(cur.inputs.sampling.want_logprobs.any())
        return self._collect(cur.out, self.runner.fetch(cur.result, want_logprobs))

    def _launch(self, out: SchedulerOutput, inputs: StepInputs, token_ids: Any = None,
                before_sample: Any = None) -> _Launched:
        return _Launched(out, inputs, self.runner.launch(inputs, token_ids, before_sample))

    def _launch_next(self, cur: _Launched) -> _Launched | None:
        """Dispatch the decode step after ``cur`` (in flight) if it pipelines; else None."""
        ec = self.config
        nxt = plan_next_decode(self.scheduler, cur.out, cur.inputs.bucket.num_seqs,
                               ec.decode_buckets, ec.max_model_len)
        if nxt is None:
            return None
        inputs = self._inputs(nxt.out.chunks, False, token_on_device=True)
        if inputs is None or inputs.bucket.num_seqs != len(nxt.rows):
            return None  # its pages stay allocated: the next synchronous plan uses them
        self.num_pipelined_steps += 1
        return self._launch(nxt.out, inputs, self.runner.gather_tokens(cur.result.tokens,
                                                                       nxt.rows))

    def _collect(self, out: SchedulerOutput, res: SampleResult) -> list[RequestOutput]:
        """Record step ``out``'s sampled ``res``: append tokens, stop rules, outputs."""
        return self._collect_steps([(out, res)])

    def _collect_steps(self, steps: list[tuple[SchedulerOutput, SampleResult]]
                       ) -> list[RequestOutput]:
        """Record steps run back to back (one, or a multi-step window), in order: each
        appends its tokens under the stop rules (a row finished by an earlier step is
        skipped); then one output per request touched."""
        touched: dict[int, Sequence] = {}
        finished: list[Sequence] = []
        for out, res in steps:
            finished += engine_outputs.record_step(self, out, res, touched)
        for seq in finished:
            touched[seq.seq_id] = seq
        results = [engine_outputs.request_output(self, seq) for seq in touched.values()
                   if seq.sampling_params.output_kind != "final_only" or seq.group.is_finished]
        for seq in finished:
            self._finished(seq)
        return results

    # ------------------------------------------------------------------ research
    def prompt_logits(self, prompt: str | Seq[int]) -> np.ndarray:
        """Logits [N, V] float32 of every prompt position, through the paged engine path
        (jaxinfer/engine_logits.py). Call between steps. Raises RequestError for a prompt
        longer than max_model_len."""
        return engine_logits.prompt_logits(self, prompt)

    def prompt_kv(self, prompt: str | Seq[int]) -> tuple[np.ndarray, np.ndarray]:
        """The prompt's KV cache ``(k, v)``, each float32 [layers, tokens, KV heads, head
        dim], keys after RoPE (jaxinfer/engine_logits.py). Call between steps. Raises
        RequestError as prompt_logits."""
        return engine_logits.prompt_kv(self, prompt)


def __getattr__(name: str) -> Any:
    # ``LLM`` and ``iter_stream`` live in jaxinfer/llm.py; still importable from here.
    if name in ("LLM", "iter_stream"):
        from jaxinfer import llm

        return getattr(llm, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
