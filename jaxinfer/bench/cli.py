"""``jaxinfer bench``: argument parsers of the sub-commands, registered into ``jaxinfer.cli``
by :func:`add_bench_command`."""

from __future__ import annotations

import argparse
import math
from typing import Any


def _finite_float(text: str, zero_ok: bool) -> float:
    bound = ">= 0" if zero_ok else "> 0"
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number {bound}, got {text!r}") from None
    if not (math.isfinite(v) and (v > 0 or zero_ok and v == 0)):
        raise argparse.ArgumentTypeError(f"must be a finite number {bound}, got {text}")
    return v


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0 (a measured time, bandwidth or rate; a clear
    message otherwise, where 0 used to be ignored and -5 gave negative fractions)."""
    return _finite_float(text, zero_ok=False)


def non_negative_float(text: str) -> float:
    """argparse type: a finite number >= 0 (a time limit: 0 stops after the first step)."""
    return _finite_float(text, zero_ok=True)


def token_id_list(text: str) -> list[int]:
    """argparse type: comma-separated token ids >= 0 ("2,5, 7"); "" is none."""
    try:
        ids = [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be comma-separated integers, got {text!r}") from None
    if bad := [t for t in ids if t < 0]:
        raise argparse.ArgumentTypeError(f"token ids must be >= 0, got {bad[0]}")
    return ids


def add_structured_output_flags(p: argparse.ArgumentParser) -> None:
    """``--json-schema``, ``--regex``, ``--choice`` (read by :func:`structured_from_flags`)."""
    so = p.add_argument_group("structured outputs (at most one; vLLM's StructuredOutputsParams)")
    so.add_argument("--json-schema", type=json_schema_arg, default=None, metavar="SCHEMA",
                    help="the output is JSON matching this schema (JSON text, or @FILE)")
    so.add_argument("--regex", default=None, help="the output matches this regex")
    so.add_argument("--choice", action="append", default=None, metavar="TEXT",
                    help="the output is one of these strings (repeat the flag for more)")


def structured_from_flags(ns: argparse.Namespace) -> dict[str, Any] | None:
    """The structured-outputs flags in SamplingParams' dict form (``{"regex": ...}``); None
    when none is given. Raises ValueError for more than one."""
    given = {k: v for k, v in (("json", ns.json_schema), ("regex", ns.regex),
                               ("choice", ns.choice)) if v is not None}
    if len(given) > 1:
        raise ValueError("give at most one of --json-schema, --regex, --choice")
    return given or None


def json_schema_arg(text: str) -> str:
    """argparse type: a JSON schema as JSON text, or ``@PATH`` of a file holding one; returns
    the text (structured outputs check it further)."""
    import json

    if text.startswith("@"):
        try:
            text = open(text[1:], encoding="utf-8").read()
        except OSError as e:
            raise argparse.ArgumentTypeError(f"cannot read the schema file {text[1:]!r}: "
                                             f"{e.strerror or e}") from None
    try:
        obj = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"must be a JSON schema (JSON text or @file): {e}") \
            from None
    if not isinstance(obj, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON schema (a JSON object), got "
                                         f"{type(obj).__name__}")
    return text


def logit_bias_json(text: str) -> dict[int, float]:
    """argparse type: a JSON object of token id -> bias, OpenAI's ``logit_bias`` form
    (``'{"50256": -100, "13": 2.5}'``; keys strings of ints >= 0, values numbers)."""
    import json

    try:
        obj = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"must be a JSON object of token id -> bias, got "
                                         f"{text!r} ({e})") from None
    if not isinstance(obj, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object of token id -> bias, got "
                                         f"{text!r}")
    out = {}
    for k, v in obj.items():
        if not k.strip().isdigit():
            raise argparse.ArgumentTypeError(f"keys must be token ids (ints >= 0), got {k!r}")
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise argparse.ArgumentTypeError(f"the bias of token {k} must be a number, got "
                                             f"{v!r}")
        if int(k) in out:  # "13" and "013" (JSON keeps both)
            raise argparse.ArgumentTypeError(f"token {int(k)} is given twice")
        out[int(k)] = float(v)
    return out


def add_common(p: argparse.ArgumentParser) -> None:
    """Engine options (as ``jaxinfer generate``), ``--out``, ``--progress-interval``.

    ``--max-num-seqs`` and ``--max-model-len`` default to None here: each benchmark derives
    them from its workload (number of requests, lengths) unless given.
    """
    from jaxinfer.bench.records import RESULTS
    from jaxinfer.cli_options import _add_engine_options

    before = len(p._actions)
    _add_engine_options(p)
    p.set_defaults(engine_actions=list(p._actions[before:]), max_num_seqs=None)
    p.add_argument("--out", default=None,
                   help=f"folder for the JSON records (default: {RESULTS})")
    p.add_argument("--progress-interval", type=positive_float, default=10.0,
                   help="seconds between progress lines on stderr")


def add_bench_command(sub: Any) -> None:
    """Register ``jaxinfer bench {offline,serve,latency,roofline}``."""
    from jaxinfer.bench import latency, offline, serve

    b = sub.add_parser("bench", help="benchmarks: offline throughput, serving, latency, "
                                     "roofline (README 'Benchmarks')")
    bsub = b.add_subparsers(dest="bench_command", required=True)
    offline.add_parser(bsub, add_common)
    serve.add_parser(bsub, add_common)
    latency.add_parser(bsub, add_common)
    add_roofline_parser(bsub)


def add_roofline_parser(sub: Any) -> None:
    r = sub.add_parser("roofline", help="bytes and FLOPs of a decode step; fractions of the "
                                        "hardware's ceilings reached by a measured TPOT")
    r.add_argument("--model", default="dummy:llama-3.1-8b",
                   help="any --model of `jaxinfer generate` (only its config is read)")
    r.add_argument("--load-format", choices=["auto", "dummy"], default="auto")
    r.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    r.add_argument("--quantization", choices=["fp8"], default=None)
    r.add_argument("--batch", type=int, default=1)
    r.add_argument("--context", type=int, default=512,
                   help="tokens each sequence attends to (new token included)")
    r.add_argument("--tpot-ms", type=positive_float, default=None,
                   help="measured decode step time")
    r.add_argument("--copy-gbps", type=positive_float, default=None,
                   help="measured copy bandwidth")
    r.add_argument("--matmul-tflops", type=positive_float, default=None,
                   help="measured matmul rate")
    r.set_defaults(func=cmd_roofline)


def cmd_roofline(ns: argparse.Namespace) -> int:
    from jaxinfer.bench import roofline
    from jaxinfer.bench.metrics import format_table
    from jaxinfer.compile import model_config_of

    cfg = model_config_of(ns.model)
    if ns.batch < 1 or ns.context < 1:
        raise ValueError("--batch and --context must be >= 1")
    cost = roofline.decode_step_cost(cfg, ns.context, batch=ns.batch, dtype=ns.dtype,
                                     quantization=ns.quantization)
    rows: list[tuple[str, Any]] = [
        ("weights resident (GB)", roofline.weight_bytes(cfg, ns.dtype, ns.quantization) / 1e9),
        ("weights read per step (GB)", cost.weight_bytes / 1e9),
        ("KV read per step (GB)", cost.kv_read_bytes / 1e9),
        ("bytes per step (GB)", cost.bytes / 1e9),
        ("FLOPs per step (GFLOP)", cost.flops / 1e9),
    ]
    bw = ns.copy_gbps * 1e9 if ns.copy_gbps else None
    mm = ns.matmul_tflops * 1e12 if ns.matmul_tflops else None
    r = roofline.roofline(cost, (ns.tpot_ms or 1.0) / 1000, bw, mm)
    if r["floor_s"] is not None:
        rows.append(("step time the ceilings allow (ms)", 1000 * r["floor_s"]))
    if ns.tpot_ms:
        rows += [("achieved bandwidth (GB/s)", r["achieved_bytes_per_s"] / 1e9),
                 ("achieved compute (TFLOP/s)", r["achieved_flops_per_s"] / 1e12)]
        if r["bandwidth_frac"] is not None:
            rows.append(("fraction of copy bandwidth", r["bandwidth_frac"]))
        if r["matmul_frac"] is not None:
            rows.append(("fraction of matmul rate", r["matmul_frac"]))
    print(format_table(rows, f"roofline: {ns.model}, {ns.dtype}"
                             f"{' fp8' if ns.quantization else ''}, batch {ns.batch}, "
                             f"context {ns.context}"))
    return 0
