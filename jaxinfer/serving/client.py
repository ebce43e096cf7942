"""A small synchronous client for ``jaxinfer.v1.Inference`` (and the standard health check).

    from jaxinfer.serving.client import InferenceClient
    with InferenceClient("127.0.0.1:50051") as c:
        for r in c.generate_stream("The capital of France is", max_tokens=16, temperature=0):
            print(r.text, end="", flush=True)
        print(c.generate(messages=[{"role": "user", "content": "What is 2+2?"}]).text)

Sampling keywords are the fields of ``SamplingParameters`` in ``jaxinfer.proto`` (vLLM names:
temperature, top_k, top_p, max_tokens, min_tokens, ignore_eos, stop_token_ids, seed, ...).
Errors arrive as ``grpc.RpcError`` with the server's status code and message.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator, Sequence
from typing import Any, Self

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from jaxinfer.serving import jaxinfer_pb2 as pb
from jaxinfer.serving import jaxinfer_pb2_grpc as pb_grpc

_F32_MAX = 3.4028234663852886e38  # float32's largest finite value (protobuf float fields)


def _fill_chat(chat: pb.ChatMessages, messages: Sequence[dict[str, str]],
               options: dict[str, Any] | None) -> None:
    """``chat`` from messages and chat options (add_generation_prompt,
    continue_final_message: bools; chat_template_kwargs: a JSON-like dict)."""
    chat.messages.extend(pb.ChatMessage(role=m["role"], content=m["content"])
                         for m in messages)
    opts = dict(options or {})
    kwargs = opts.pop("chat_template_kwargs", None)
    unknown = set(opts) - {"add_generation_prompt", "continue_final_message"}
    if unknown:
        raise ValueError(f"unknown chat option(s) {sorted(unknown)}: add_generation_prompt, "
                         f"continue_final_message, chat_template_kwargs")
    for k, v in opts.items():
        if v is not None and not isinstance(v, bool):
            raise ValueError(f"chat option {k} must be a bool, got {v!r}")
        if v is not None:
            setattr(chat, k, v)
    if kwargs is not None:
        try:
            chat.chat_template_kwargs.update(kwargs)
        except (TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"chat option chat_template_kwargs must be a JSON-like dict with "
                             f"str keys, got {kwargs!r}: {e}") from None


def build_request(prompt: str | None = None, *, token_ids: Sequence[int] | None = None,
                  messages: Sequence[dict[str, str]] | None = None, request_id: str = "",
                  chat_options: dict[str, Any] | None = None,
                  **sampling: Any) -> pb.GenerateRequest:
    """A GenerateRequest from exactly one of ``prompt`` / ``token_ids`` / ``messages``
    (``chat_options``, with ``messages``: add_generation_prompt, continue_final_message,
    chat_template_kwargs -- vLLM's names).

    Raises ValueError when not exactly one input is given, or a sampling keyword is not a
    field of the message or its value does not fit the field (naming the keyword: the server
    checks the ranges, the client only what the wire format cannot carry, e.g. a negative
    seed).
    """
    given = [x is not None for x in (prompt, token_ids, messages)]
    if sum(given) != 1:
        raise ValueError("give exactly one of prompt, token_ids, messages")
    if chat_options and messages is None:
        raise ValueError("chat_options apply to messages only")
    for t, v in (sampling.get("logit_bias") or {}).items():  # a float field: protobuf would
        # send a finite value past float32's range as inf, and the server would name inf
        if isinstance(v, (int, float)) and math.isfinite(v) and abs(v) > _F32_MAX:
            raise ValueError(f"sampling parameter logit_bias[{t}]={v!r} does not fit the "
                             f"request: it is past float32's range (|x| <= {_F32_MAX:.4g})")
    for k in ("stop", "bad_words"):  # a str is one string, as SamplingParams takes it
        if isinstance(sampling.get(k), str):  # (protobuf would send its characters)
            sampling = {**sampling, k: [sampling[k]]}
    try:
        params = pb.SamplingParameters(**sampling)
    except (TypeError, ValueError):  # protobuf's message names no field: find the keyword
        for k, v in sampling.items():
            try:
                pb.SamplingParameters(**{k: v})
            except (TypeError, ValueError) as e:
                raise ValueError(f"sampling parameter {k}={v!r} does not fit the request: "
                                 f"{e}") from None
        raise
    req = pb.GenerateRequest(request_id=request_id, sampling=params)
    if prompt is not None:
        req.prompt = prompt
    elif token_ids is not None:
        req.prompt_token_ids.ids.extend(int(t) for t in token_ids)
    else:
        _fill_chat(req.chat, messages or (), chat_options)
    return req


class InferenceClient:
    """Blocking client over one insecure channel.

    Args:
      target: ``host:port`` of a ``jaxinfer serve``.
      timeout: default per-call deadline in seconds (None: none).
    """

    def __init__(self, target: str = "127.0.0.1:50051", timeout: float | None = None) -> None:
        self.channel = grpc.insecure_channel(target)
        self.stub = pb_grpc.InferenceStub(self.channel)
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)
        self.timeout = timeout

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.channel.close()

    def _t(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is None else timeout

    def generate_stream(self, prompt: str | None = None, *, timeout: float | None = None,
                        **kw: Any) -> Iterator[pb.GenerateResponse]:
        """Stream of responses (new token ids + text delta; the last has finish_reason and
        usage; with ``n`` > 1 each message is one sample's, ``index``, and each sample's last
        has its finish_reason and usage). Keywords: see :func:`build_request`. ``.cancel()``
        on the returned iterator aborts the request on the server."""
        return self.stub.Generate(build_request(prompt, **kw), timeout=self._t(timeout))

    def generate(self, prompt: str | None = None, *, timeout: float | None = None,
                 **kw: Any) -> pb.GenerateResponse:
        """The whole completion in one response (GenerateUnary)."""
        return self.stub.GenerateUnary(build_request(prompt, **kw), timeout=self._t(timeout))

    def tokenize(self, text: str | None = None,
                 messages: Sequence[dict[str, str]] | None = None,
                 chat_options: dict[str, Any] | None = None) -> list[int]:
        req = pb.TokenizeRequest()
        if chat_options and messages is None:
            raise ValueError("chat_options apply to messages only")
        if messages is not None:
            _fill_chat(req.chat, messages, chat_options)
        else:
            req.text = text or ""
        return list(self.stub.Tokenize(req, timeout=self.timeout).token_ids)

    def detokenize(self, token_ids: Sequence[int]) -> str:
        return self.stub.Detokenize(pb.DetokenizeRequest(token_ids=list(token_ids)),
                                    timeout=self.timeout).text

    def model_info(self) -> pb.ModelInfoResponse:
        return self.stub.ModelInfo(pb.ModelInfoRequest(), timeout=self.timeout)

    def health(self, service: str = "") -> str:
        """``SERVING`` / ``NOT_SERVING`` / ... of ``service`` ("" = the whole server)."""
        r = self.health_stub.Check(health_pb2.HealthCheckRequest(service=service),
                                   timeout=self.timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)


if __name__ == "__main__":  # python -m jaxinfer.serving.client ... = jaxinfer client ...
    from jaxinfer.cli import main

    sys.exit(main(["client", *sys.argv[1:]]))
