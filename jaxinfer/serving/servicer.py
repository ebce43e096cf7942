"""The ``jaxinfer.v1.Inference`` servicer on ``grpc.aio``.

Each RPC validates its request on the event loop (errors -> ``INVALID_ARGUMENT`` naming the
field), hands it to the :class:`EngineThread` and relays what the engine produces: new token
ids, the delta of the engine's own output text (``CompletionOutput.text``: incrementally
detokenized, ``skip_special_tokens`` honoured, stop strings cut, a partial one held back),
logprobs, prompt logprobs, finish and stop reason -- per sample (``index``) when the request
asks for ``n > 1`` samples. When a stream ends early -- the client cancelled,
its deadline passed, the server is stopping -- the handler's ``finally`` aborts the request,
which frees its KV pages at the engine's next step boundary.

Tokenization (a request's prompt or chat, the Tokenize and Detokenize RPCs) runs on one
worker thread, not on the event loop, so a long prompt does not hold up other streams,
requests given as token ids or the health check (texts are encoded one at a time, in arrival
order); a prompt or Tokenize text that cannot fit ``max_model_len`` is refused before it is
encoded (``Tokenizer.min_tokens``; vLLM's /tokenize refuses it too).
:func:`add_to_server` registers the RPCs with a deserializer that turns bytes which do not parse
(e.g. a string field that is not UTF-8) into INVALID_ARGUMENT instead of gRPC's UNKNOWN.

Status codes: INVALID_ARGUMENT (bad parameters, empty / too long prompt, malformed chat,
unknown fields, a request that does not parse); RESOURCE_EXHAUSTED (the waiting queue is at
``max_queue_len``); UNAVAILABLE (shutting down); INTERNAL (a fault while serving that
request; the server keeps serving).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import grpc
from google.protobuf.message import DecodeError

from jaxinfer.prompts import check_text_fits, fit_max_tokens
from jaxinfer.serving import jaxinfer_pb2 as pb
from jaxinfer.serving import jaxinfer_pb2_grpc as pb_grpc
from jaxinfer.serving.engine_thread import (
    EngineStopped,
    QueueFull,
    Rejected,
    RequestHandle,
    StreamItem,
)
from jaxinfer.serving.protocol import (
    FINISH_REASONS,
    InvalidRequest,
    chat_messages,
    chat_options,
    mistyped_fields,
    model_info,
    prompt_logprobs_proto,
    prompt_token_ids,
    sampling_params_from_proto,
    set_stop_reason,
    token_logprobs,
    unknown_fields,
)

if TYPE_CHECKING:
    from jaxinfer.serving.engine_thread import EngineThread
    from jaxinfer.serving.metrics import ServingMetrics

log = logging.getLogger(__name__)

_ERROR_STATUS = ((Rejected, grpc.StatusCode.INVALID_ARGUMENT, "invalid_argument"),
                 (QueueFull, grpc.StatusCode.RESOURCE_EXHAUSTED, "resource_exhausted"),
                 (EngineStopped, grpc.StatusCode.UNAVAILABLE, "error"))


class InferenceServicer(pb_grpc.InferenceServicer):
    """Implements the RPCs of ``jaxinfer.proto`` over one :class:`EngineThread`."""

    def __init__(self, engine_thread: EngineThread, metrics: ServingMetrics | None = None):
        self.et = engine_thread
        self.engine = engine_thread.engine  # read-only here: tokenizer, configs
        self.metrics = metrics
        self._info = model_info(self.engine)
        # One thread: encodes stay in arrival order and the tokenizer is never entered by two
        # encodes at once (the engine thread only decodes).
        self._tokenize_pool = ThreadPoolExecutor(1, thread_name_prefix="jaxinfer-tokenize")

    def close(self) -> None:
        """Stop the tokenization thread (after the server stopped)."""
        self._tokenize_pool.shutdown(wait=False, cancel_futures=True)

    async def _off_loop(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._tokenize_pool, fn, *args)

    # ------------------------------------------------------------------ generation
    async def _start(self, req: pb.GenerateRequest,
                     context: grpc.aio.ServicerContext) -> RequestHandle:
        arrival = time.monotonic()  # TTFT / end-to-end clocks include tokenization
        try:
            params = sampling_params_from_proto(req.sampling, self.engine.sampling_defaults)
            trunc = params.truncate_prompt_tokens
            if req.WhichOneof("input") == "prompt_token_ids":  # no tokenizer: checked here
                ids, text = prompt_token_ids(self.engine, req, trunc)
            else:  # one tokenizer thread, as vLLM's API server (its tokenizer executor)
                ids, text = await self._off_loop(prompt_token_ids, self.engine, req, trunc)
        except InvalidRequest as e:
            await self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e),
                              "invalid_argument")
        if not req.sampling.HasField("max_tokens"):  # vLLM's OpenAI server: the model's
            # max_new_tokens capped at the room the prompt leaves, else all of that room
            if "max_tokens" not in self.engine.sampling_defaults:
                params = dataclasses.replace(params, max_tokens=None)
            params = fit_max_tokens(params, len(ids), self.engine.config.max_model_len)
        handle = RequestHandle(ids, params, text)
        handle.arrival = arrival
        try:
            self.et.submit(handle)
        except EngineStopped as e:
            await self._abort(context, grpc.StatusCode.UNAVAILABLE, str(e), "error")
        return handle

    async def _abort(self, context: grpc.aio.ServicerContext, code: grpc.StatusCode,
                     msg: str, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.on_rejected(outcome)
        await context.abort(code, msg)  # raises

    async def _items(self, handle: RequestHandle,
                     context: grpc.aio.ServicerContext) -> AsyncIterator[list[StreamItem]]:
        """Batches of items as they arrive (everything already queued is coalesced); aborts
        the RPC with the mapped status on an error item."""
        while True:
            items = [await handle.queue.get()]
            while not handle.queue.empty():
                items.append(handle.queue.get_nowait())
            for it in items:
                if it.error is not None:
                    handle.finished = True
                    code, outcome = grpc.StatusCode.INTERNAL, "error"
                    for cls, c, o in _ERROR_STATUS:
                        if isinstance(it.error, cls):
                            code, outcome = c, o
                    await self._abort(context, code, str(it.error), outcome)
            yield items
            if items[-1].last:
                handle.finished = True
                return

    def _response(self, request: pb.GenerateRequest, handle: RequestHandle,
                  items: list[StreamItem], num_tokens: int) -> pb.GenerateResponse:
        """One GenerateResponse from consecutive items of one sample (a stream message, or
        all of a unary request's); ``num_tokens``: the sample's completion tokens so far
        (usage, on its final one)."""
        params = handle.params
        ids = [t for it in items for t in it.token_ids]
        resp = pb.GenerateResponse(request_id=request.request_id, token_ids=ids,
                                   text="".join(it.text for it in items), index=items[0].index)
        if params.logprobs is not None:
            entries = [e for it in items for e in (it.logprobs or [])]
            resp.logprobs.extend(token_logprobs(ids, entries, params.logprobs))
        plp = next((it.prompt_logprobs for it in items if it.prompt_logprobs is not None), None)
        if plp is not None and params.prompt_logprobs is not None:
            resp.prompt_logprobs.extend(
                prompt_logprobs_proto(handle.prompt_ids, plp, params.prompt_logprobs))
        last = items[-1]
        if last.finish_reason is not None:
            resp.finish_reason = FINISH_REASONS[last.finish_reason]
            set_stop_reason(resp, last.stop_reason)
            if last.cumulative_logprob is not None:
                resp.cumulative_logprob = last.cumulative_logprob
            resp.usage.prompt_tokens = len(handle.prompt_ids)
            resp.usage.completion_tokens = num_tokens
        return resp

    async def Generate(self, request: pb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        handle = await self._start(request, context)
        sent = [0] * handle.params.n  # tokens per sample
        try:
            async for items in self._items(handle, context):
                for index, part in _by_sample(items):  # one message per sample
                    sent[index] += sum(len(it.token_ids) for it in part)
                    resp = self._response(request, handle, part, sent[index])
                    if (resp.token_ids or resp.text or resp.prompt_logprobs
                            or part[-1].finish_reason is not None):
                        yield resp
        finally:
            if not handle.finished:  # cancelled, deadline passed, or the server is stopping
                self.et.abort(handle)

    async def GenerateUnary(self, request: pb.GenerateRequest,
                            context: grpc.aio.ServicerContext) -> pb.GenerateResponse:
        handle = await self._start(request, context)
        got: list[StreamItem] = []
        try:
            async for items in self._items(handle, context):
                got += items
        finally:
            if not handle.finished:
                self.et.abort(handle)
        samples = [self._response(request, handle, part, sum(len(it.token_ids) for it in part))
                   for _, part in sorted(_by_sample(got), key=lambda ip: ip[0])]
        top = pb.GenerateResponse()
        top.CopyFrom(samples[0])
        if len(samples) > 1:
            for r in samples:
                r.ClearField("prompt_logprobs")  # the top level carries them
            top.samples.extend(samples)
        return top

    # ------------------------------------------------------------------ tokenizer
    async def _tokenizer(self, context: grpc.aio.ServicerContext) -> Any:
        tok = self.engine.tokenizer
        if tok is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "this model has no tokenizer")
        return tok

    async def Tokenize(self, request: pb.TokenizeRequest,
                       context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        tok = await self._tokenizer(context)
        kind = request.WhichOneof("input")
        limit = self.engine.config.max_model_len
        try:
            if kind == "text":  # as vLLM's /tokenize: a text that cannot fit is refused
                add = (request.add_special_tokens if request.HasField("add_special_tokens")
                       else True)
                check_text_fits(tok, (request.text,), limit)  # a lower bound, before encoding
                ids = await self._off_loop(tok.encode, request.text, add)
                if len(ids) > limit:
                    raise InvalidRequest(f"the text is {len(ids)} tokens; max_model_len is "
                                         f"{limit}")
            elif kind == "chat":  # as for text (a 5,031-token chat came back at limit 256)
                ids = await self._off_loop(functools.partial(
                    self.engine.encode_chat, chat_messages(request.chat),
                    **chat_options(request.chat)))
                if len(ids) > limit:
                    raise InvalidRequest(f"the conversation is {len(ids)} tokens; "
                                         f"max_model_len is {limit}")
            else:
                raise InvalidRequest("request has no input: set text or chat")
        except Exception as e:  # noqa: BLE001 - InvalidRequest, TokenizerError, jinja2 errors
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"{kind}: {e}" if kind else str(e))
        return pb.TokenizeResponse(token_ids=ids)

    async def Detokenize(self, request: pb.DetokenizeRequest,
                         context: grpc.aio.ServicerContext) -> pb.DetokenizeResponse:
        tok = await self._tokenizer(context)
        V = self.engine.model_config.vocab_size
        bad = [t for t in request.token_ids if t >= V]
        if bad:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"token_ids: {bad[0]} is not in [0, {V})")
        skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        text = await self._off_loop(tok.decode, list(request.token_ids), skip)
        return pb.DetokenizeResponse(text=text)

    async def ModelInfo(self, request: pb.ModelInfoRequest,
                        context: grpc.aio.ServicerContext) -> pb.ModelInfoResponse:
        return self._info



class _Malformed:
    """Handed to an RPC's behaviour in place of a request whose bytes did not parse."""

    def __init__(self, error: str) -> None:
        self.error = error


def _deserializer(cls: Any) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            msg = cls.FromString(data)
        except DecodeError as e:  # e.g. "String field had bad UTF-8"
            return _Malformed(f"the {cls.DESCRIPTOR.name} does not parse: {e}")
        if unknown := unknown_fields(msg):  # a newer client's field: refused, not dropped
            return _Malformed(f"{cls.DESCRIPTOR.name} has fields this server does not know: "
                              f"{', '.join(unknown)} (field numbers; a newer client?)")
        if mistyped := mistyped_fields(msg):  # (was reported as an unknown field)
            return _Malformed(f"{cls.DESCRIPTOR.name} has fields of the wrong wire type: "
                              f"{', '.join(mistyped)} (a client built from another schema?)")
        return msg
    return parse


def add_to_server(servicer: InferenceServicer, server: grpc.aio.Server) -> None:
    """Register ``servicer``'s RPCs on ``server`` (as the generated
    ``add_InferenceServicer_to_server``, from the same service descriptor), with requests
    that do not parse answered INVALID_ARGUMENT (and counted as such in the metrics)."""
    service = pb.DESCRIPTOR.services_by_name["Inference"]

    async def refuse(request: _Malformed, context: grpc.aio.ServicerContext) -> None:
        await servicer._abort(context, grpc.StatusCode.INVALID_ARGUMENT, request.error,
                              "invalid_argument")

    def unary(behavior: Callable[..., Any]) -> Callable[..., Any]:
        async def handle(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if isinstance(request, _Malformed):
                await refuse(request, context)
            return await behavior(request, context)
        return handle

    def streaming(behavior: Callable[..., Any]) -> Callable[..., Any]:
        async def handle(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            if isinstance(request, _Malformed):
                await refuse(request, context)
            responses = behavior(request, context)
            try:
                async for r in responses:
                    yield r
            finally:  # its own finally (the request's abort) runs now, not at GC
                await responses.aclose()
        return handle

    handlers = {}
    for m in service.methods:
        make, wrap = ((grpc.unary_stream_rpc_method_handler, streaming) if m.server_streaming
                      else (grpc.unary_unary_rpc_method_handler, unary))
        request_cls, response_cls = getattr(pb, m.input_type.name), getattr(pb, m.output_type.name)
        handlers[m.name] = make(wrap(getattr(servicer, m.name)),
                                request_deserializer=_deserializer(request_cls),
                                response_serializer=response_cls.SerializeToString)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)


def _by_sample(items: list[StreamItem]) -> list[tuple[int, list[StreamItem]]]:
    """Items grouped by sample index, in the order each sample first appears."""
    groups: dict[int, list[StreamItem]] = {}
    for it in items:
        groups.setdefault(it.index, []).append(it)
    return list(groups.items())
