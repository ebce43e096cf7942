"""``jaxinfer serve`` and ``jaxinfer client``: argument parsers and commands, registered into
``jaxinfer.cli`` by :func:`add_serve_parser` and :func:`add_client_parser`."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from jaxinfer.bench.cli import (
    add_structured_output_flags,
    logit_bias_json,
    non_negative_float,
    structured_from_flags,
    token_id_list,
)


def port_number(text: str) -> int:
    """argparse type: a TCP port, an int in [0, 65535] (a clear message otherwise; the
    socket layer would take 99999 as 99999 mod 65536)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an int in [0, 65535], got {text!r}") from None
    if not 0 <= n <= 65535:
        raise argparse.ArgumentTypeError(f"must be in [0, 65535], got {n}")
    return n


def add_serving_commands(sub: Any) -> None:
    """Register ``serve`` and ``client`` on the ``jaxinfer`` CLI's subparsers."""
    add_serve_parser(sub)
    add_client_parser(sub)


def _add_if_missing(p: argparse.ArgumentParser, flag: str, **kw: Any) -> None:
    # The shared engine options may already define it (they grow over time).
    if flag not in p._option_string_actions:
        p.add_argument(flag, **kw)


def add_serve_parser(sub: Any) -> None:
    """Register ``jaxinfer serve`` on the CLI's subparsers."""
    from jaxinfer.cli_options import _add_engine_options, _add_xla_cache_option
    from jaxinfer.serving import DEFAULT_PORT

    p = sub.add_parser("serve", help="serve the model over gRPC (jaxinfer.v1.Inference)")
    _add_engine_options(p)
    _add_xla_cache_option(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=port_number, default=DEFAULT_PORT,
                   help="gRPC port, 0-65535 (0: any free)")
    p.add_argument("--metrics-port", type=port_number, default=None,
                   help="Prometheus /metrics port on --host (default: off)")
    _add_if_missing(p, "--max-num-batched-tokens", type=int, default=None,
                    help="most prompt tokens in one prefill step")
    _add_if_missing(p, "--num-kv-pages", type=int, default=None, help="KV pool size in pages")
    _add_if_missing(p, "--max-queue-len", type=int, default=None,
                    help="most waiting requests; more get RESOURCE_EXHAUSTED (default: none)")
    p.add_argument("--drain-timeout", type=non_negative_float, default=30.0,
                   help="seconds (>= 0) in-flight streams may run after SIGTERM")
    p.add_argument("--warmup-prefill", action=argparse.BooleanOptionalAction, default=None,
                   help="the warm-up also builds every prefill program (one per token bucket "
                        "with the GPU's Pallas kernels), so no prompt stalls running streams "
                        "while its bucket compiles; start-up takes longer (default: on a GPU, "
                        "not on the CPU, where the reference attention has many more)")
    p.add_argument("--no-warmup", action="store_true",
                   help="report SERVING without compiling the common programs first")
    p.add_argument("--generation-config", choices=["auto", "vllm"], default="auto",
                   help="auto: a request's unset sampling fields take the defaults of the "
                        "checkpoint's generation_config.json (temperature, top_k, top_p, "
                        "min_p, repetition_penalty, max_new_tokens), as vLLM's; vllm: "
                        "SamplingParams' own (temperature 1.0, ...)")
    p.set_defaults(func=cmd_serve)


def _warmup_mode(ns: argparse.Namespace) -> bool | str:
    """InferenceServer's ``warmup``: False (--no-warmup), "prefill" (--warmup-prefill), True
    (--no-warmup-prefill: the decode programs only) or "auto" (neither: the prefill programs
    too on a GPU backend; ``warmup.resolve_warmup``)."""
    if ns.no_warmup:
        return False
    if ns.warmup_prefill is None:
        return "auto"
    return "prefill" if ns.warmup_prefill else True


def cmd_serve(ns: argparse.Namespace) -> int:
    import asyncio

    from jaxinfer.cli_options import _engine_args, _xla_cache
    from jaxinfer.engine import LLMEngine
    from jaxinfer.serving.server import ServerError, check_port_free, serve

    args = _engine_args(ns)
    for name in ("max_num_batched_tokens", "num_kv_pages"):
        if name not in args and getattr(ns, name, None) is not None:
            args[name] = getattr(ns, name)
    try:  # a taken port fails here, before the model loads, and again at the real bind
        check_port_free(ns.host, ns.port)
        if ns.metrics_port is not None:
            check_port_free(ns.host, ns.metrics_port, "serve metrics")
        _xla_cache(ns)
        engine = LLMEngine(ns.model, **args)
        return asyncio.run(serve(engine, ns.host, ns.port, ns.metrics_port, ns.max_queue_len,
                                 ns.drain_timeout, warmup=_warmup_mode(ns)))
    except ServerError as e:
        print(f"jaxinfer: error: {e}", file=sys.stderr)
        return 2


def add_client_parser(sub: Any) -> None:
    """Register ``jaxinfer client`` on the CLI's subparsers."""
    p = sub.add_parser("client", help="send a prompt to a `jaxinfer serve` (streams tokens)")
    p.add_argument("--address", default="127.0.0.1:50051", help="host:port of the server")
    form = p.add_mutually_exclusive_group()
    form.add_argument("--chat", action="store_true", help="send the prompt as a user message")
    form.add_argument("--token-ids", action="store_true",
                      help="the prompt is space-separated token ids")
    p.add_argument("--unary", action="store_true", help="one response (GenerateUnary)")
    p.add_argument("--info", action="store_true", help="print ModelInfo and health as JSON")
    p.add_argument("--timeout", type=_deadline, default=None,
                   help="deadline in seconds, > 0 and at most a year")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--min-tokens", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--stop-token-ids", type=token_id_list, default=None,
                   help="comma-separated token ids that end the output")
    p.add_argument("--allowed-token-ids", type=token_id_list, default=None,
                   help="comma-separated token ids: sample only among these")
    p.add_argument("--logit-bias", type=logit_bias_json, default=None,
                   help='JSON token id -> bias added to its logit, e.g. \'{"13": -100}\'')
    p.add_argument("--bad-words", action="append", default=None, metavar="WORD",
                   help="a word never generated (repeat the flag for more)")
    p.add_argument("--truncate-prompt-tokens", type=int, default=None,
                   help="keep only the prompt's last k tokens (-1: max_model_len)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--n", type=int, default=None, metavar="K",
                   help="K samples of the prompt (vLLM's n), printed one after the other "
                        "under '--- sample i' (a stream's are collected, then printed)")
    add_structured_output_flags(p)
    p.add_argument("--show-ids", action="store_true", help="print token ids after the text")
    p.add_argument("prompt", nargs="?", default=None)
    p.set_defaults(func=cmd_client)


_MAX_DEADLINE_S = 365 * 86400.0  # gRPC's deadline arithmetic overflows far beyond


def _deadline(text: str) -> float:
    """argparse type: a finite number of seconds in (0, a year] (0, -1 and nan used to reach
    gRPC and come back as DEADLINE_EXCEEDED, 1e300 too, by overflow)."""
    from jaxinfer.bench.cli import positive_float

    s = positive_float(text)
    if s > _MAX_DEADLINE_S:
        raise argparse.ArgumentTypeError(f"must be at most {_MAX_DEADLINE_S:.0f} s (a year), "
                                         f"got {text!r}")
    return s


def _client_token_ids(text: str) -> list[int] | str:
    """``--token-ids`` prompt -> ids, or the error message (ids are uint32 on the wire:
    -5 used to print only protobuf's "Value out of range: -5")."""
    try:
        ids = [int(t) for t in text.split()]
    except ValueError:
        return f"client --token-ids: {text!r} is not space-separated integers"
    bad = [t for t in ids if not 0 <= t < 2**32]
    if bad:
        return f"client --token-ids: token id {bad[0]} is not in [0, 2**32)"
    return ids


def cmd_client(ns: argparse.Namespace) -> int:
    import grpc
    from google.protobuf.json_format import MessageToDict

    from jaxinfer.serving.client import InferenceClient

    with InferenceClient(ns.address, timeout=ns.timeout) as c:
        try:
            if ns.info:
                info = MessageToDict(c.model_info(), preserving_proto_field_name=True)
                info["health"] = c.health()
                print(json.dumps(info, indent=1))
                return 0
            if ns.prompt is None:
                print("jaxinfer: error: client: a prompt is needed (or --info)", file=sys.stderr)
                return 2
            from jaxinfer.tokenizer import utf8_problem

            if (why := utf8_problem(ns.prompt)) is not None:  # (bytes in argv)
                print(f"jaxinfer: error: client: the prompt {why}", file=sys.stderr)
                return 2
            sampling = {k: getattr(ns, k) for k in ("max_tokens", "temperature", "top_k",
                                                    "top_p", "min_tokens", "seed",
                                                    "stop_token_ids", "truncate_prompt_tokens",
                                                    "allowed_token_ids", "logit_bias",
                                                    "bad_words", "n")
                        if getattr(ns, k) is not None}
            if ns.ignore_eos:
                sampling["ignore_eos"] = True
            if (so := structured_from_flags(ns)) is not None:  # (the message's choice form)
                sampling["structured_outputs"] = (
                    {"choice": {"choices": so["choice"]}} if "choice" in so else so)
            if ns.chat:
                inp: dict[str, Any] = {"messages": [{"role": "user", "content": ns.prompt}]}
            elif ns.token_ids:
                ids_or_error = _client_token_ids(ns.prompt)
                if isinstance(ids_or_error, str):
                    print(f"jaxinfer: error: {ids_or_error}", file=sys.stderr)
                    return 2
                inp = {"token_ids": ids_or_error}
            else:
                inp = {"prompt": ns.prompt}
            if (ns.n or 1) > 1:
                _print_samples(c, inp, sampling, ns.unary, ns.show_ids)
                return 0
            ids: list[int] = []
            if ns.unary:
                r = c.generate(**inp, **sampling)
                ids, reason = list(r.token_ids), r.finish_reason
                print(r.text, end="")
            else:
                for r in c.generate_stream(**inp, **sampling):
                    ids += r.token_ids
                    reason = r.finish_reason
                    print(r.text, end="", flush=True)
            print()
            if ns.show_ids:
                _print_ids(ids, reason)
        except grpc.RpcError as e:
            print(f"jaxinfer: error: {e.code().name}: {e.details()}", file=sys.stderr)
            return 2
    return 0


def _print_ids(ids: list[int], reason: int) -> None:
    from jaxinfer.serving import jaxinfer_pb2 as pb

    print(json.dumps({"token_ids": ids, "finish_reason": pb.FinishReason.Name(reason)}))


def _print_samples(c: Any, inp: dict[str, Any], sampling: dict[str, Any], unary: bool,
                   show_ids: bool) -> None:
    """``client --n K``: each sample's text (and ids) under ``--- sample i``, in index
    order; a stream's messages (tagged by ``index``) are collected first."""
    texts: dict[int, str] = {}
    ids: dict[int, list[int]] = {}
    reasons: dict[int, int] = {}
    if unary:
        for r in c.generate(**inp, **sampling).samples:
            texts[r.index], ids[r.index], reasons[r.index] = r.text, list(r.token_ids), \
                r.finish_reason
    else:
        for r in c.generate_stream(**inp, **sampling):
            texts[r.index] = texts.get(r.index, "") + r.text
            ids.setdefault(r.index, []).extend(r.token_ids)
            reasons[r.index] = r.finish_reason
    for i in sorted(texts):
        print(f"--- sample {i}")
        print(texts[i])
        if show_ids:
            _print_ids(ids[i], reasons[i])
