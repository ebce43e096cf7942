"""``jaxinfer`` command line: generate | chat | convert | compile | serve | client | bench.

Errors that come from bad input (a missing checkpoint, a bad parameter, a too-long prompt)
print one line ``jaxinfer: error: ...`` and exit with status 2; nothing else is printed.
"""

from __future__ import annotations

import argparse
import collections
import logging
import os
import sys
import time
import warnings
from typing import Sequence as Seq

from jaxinfer.cli_options import (  # noqa: F401 (tests and callers use them as cli.X)
    DEFAULT_MODEL,
    _add_engine_options,
    _add_sampling_options,
    _add_xla_cache_option,
    _engine_args,
    _fit_max_tokens,
    _ints,
    _sampling,
    _token_ids,
    _xla_cache,
    model_spec,
)

def cmd_generate(ns: argparse.Namespace) -> int:
    from jaxinfer.llm import LLM

    params = _sampling(ns)
    if ns.chat and (empty := [i for i, p in enumerate(ns.prompt) if not p.strip()]):
        raise ValueError(f"--chat: prompt {empty[0]} is empty (nothing to say)")
    t_start = time.perf_counter()
    _xla_cache(ns)
    llm = LLM(ns.model, **_engine_args(ns))
    t_load = time.perf_counter() - t_start
    engine, runner = llm.engine, llm.engine.runner
    t0 = time.perf_counter()
    ids = []
    for i, p in enumerate(ns.prompt):  # encoded here: --chat renders a conversation
        try:
            ids.append(engine.encode_chat([{"role": "user", "content": p}]) if ns.chat
                       else engine.encode_prompt(_token_ids(p) if ns.token_ids else p))
        except ValueError as err:
            err.args = (f"prompt {i} of the batch: {err}", *err.args[1:])  # LLM.generate's
            raise
    outs = llm.generate(ids, params)  # max_tokens capped to each prompt's room there
    dt = time.perf_counter() - t0
    t_compile = sum(runner.compile_seconds.values())
    for prompt, out in zip(ns.prompt, outs):
        if len(ns.prompt) > 1:
            print(f"### {prompt}")
        for c in out.outputs:
            if len(out.outputs) > 1:
                print(f"--- sample {c.index}")
            if ns.token_ids:
                print(" ".join(map(str, c.token_ids)) + (f"  {c.text!r}" if c.text else ""),
                      flush=True)
            else:
                print(c.text if ns.chat else prompt + c.text, flush=True)
    n = sum(len(c.token_ids) for o in outs for c in o.outputs)
    run = max(dt - t_compile, 1e-9)
    reasons = collections.Counter(c.finish_reason for o in outs for c in o.outputs)
    finish = ", ".join(r if k == 1 and len(reasons) == 1 else f"{r} {k}"
                       for r, k in sorted(reasons.items()))  # "stop" | "length 2, stop 1"
    print(f"[{n} tokens in {run:.2f} s ({n / run:.1f} tok/s) after {t_load:.1f} s loading and "
          f"{t_compile:.1f} s building {runner.num_compilations} compiled + "
          f"{runner.num_loaded} cached programs; finish_reason: {finish}]", file=sys.stderr)
    return 0


def cmd_chat(ns: argparse.Namespace) -> int:
    from jaxinfer.engine import LLMEngine
    from jaxinfer.llm import iter_stream
    from jaxinfer.prompts import PromptTooLongError

    params = _sampling(ns)
    if params.n != 1:
        raise ValueError(f"chat streams one reply a turn: --n must be 1, got {params.n}")
    _xla_cache(ns)
    engine = LLMEngine(ns.model, **_engine_args(ns))
    if engine.tokenizer is None:
        raise SystemExit("jaxinfer: error: this model has no tokenizer, so no chat")
    V = engine.model_config.vocab_size
    for flag, ids in (("--stop-token-ids", params.stop_token_ids),
                      ("--logit-bias", params.logit_bias or ())):
        if bad := [t for t in ids if t >= V]:  # (else every turn is dropped)
            raise ValueError(f"{flag} {bad} are not in the vocabulary: ids must be in "
                             f"[0, {V})")
    if params.bad_words:  # (the same: refused now, not at every turn)
        from jaxinfer.sampling_bad_words import encode_bad_words

        encode_bad_words(engine.tokenizer, params.bad_words, V)
    if params.structured_outputs is not None:  # (and the grammar)
        engine.structured.check(params.structured_outputs)
    history: list[dict[str, str]] = []
    if ns.system:
        history.append({"role": "system", "content": ns.system})
    print("jaxinfer chat — /new starts a new conversation; empty line or Ctrl-D quits",
          file=sys.stderr)
    while True:
        try:
            line = input("> ").strip()
        except EOFError:
            break
        if not line:
            break
        if line == "/new":  # the system prompt stays
            del history[bool(ns.system):]
            print("jaxinfer chat: new conversation", file=sys.stderr)
            continue
        history.append({"role": "user", "content": line})
        try:  # a turn that cannot fit: say why, drop it, keep the conversation
            ids = engine.encode_chat(history)
            turn = _fit_max_tokens(ns, params, len(ids), engine.config.max_model_len)
            rid = engine.add_request(None, turn, prompt_token_ids=ids)  # type: ignore[arg-type]
        except ValueError as err:  # RequestError, TokenizerError
            history.pop()
            turns = sum(m["role"] == "assistant" for m in history)
            hint = (f"; the conversation holds {turns} earlier turn{'s' * (turns > 1)} within "
                    f"max_model_len {engine.config.max_model_len}: type /new to start a new "
                    f"conversation" if turns and isinstance(err, PromptTooLongError) else "")
            print(f"jaxinfer chat: {err} (turn dropped{hint})", file=sys.stderr)
            continue
        shown = ""
        text = ""
        out = None
        for out in iter_stream(engine, rid):
            text = out.outputs[0].text
            safe = text[:-1] if text.endswith("\ufffd") and not out.finished else text
            print(safe[len(shown):], end="", flush=True)
            shown = safe
        print()
        if out is not None and out.outputs[0].finish_reason == "length":
            print(f"jaxinfer chat: reply cut at {len(out.outputs[0].token_ids)} tokens "
                  f"(max_tokens {turn.max_tokens}; max_model_len "
                  f"{engine.config.max_model_len})", file=sys.stderr)
        history.append({"role": "assistant", "content": text})
    return 0


def cmd_convert(ns: argparse.Namespace) -> int:
    from jaxinfer.loading import convert

    path = convert(ns.model, ns.output, quantization=ns.quantization,
                   calibration=ns.calibration, calibration_tokens=ns.calibration_tokens)
    print(path)
    return 0


def _at_least_2(text: str) -> int:
    """argparse type: an int >= 2 (a clear message otherwise)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if n < 2:
        raise argparse.ArgumentTypeError(f"must be at least 2, got {n}")
    return n


def build_parser() -> argparse.ArgumentParser:
    from jaxinfer.compile_cli import add_compile_command

    parser = argparse.ArgumentParser(prog="jaxinfer", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text for one or more prompts")
    _add_engine_options(g)
    _add_xla_cache_option(g)
    _add_sampling_options(g, max_tokens=64)
    form = g.add_mutually_exclusive_group()  # a prompt is chat text or token ids, not both
    form.add_argument("--chat", action="store_true",
                      help="wrap each prompt in the chat template")
    form.add_argument("--token-ids", action="store_true",
                      help="each prompt is token ids (e.g. '1 2 3'); prints the new ids "
                           "(models without a tokenizer, such as dummy shapes)")
    g.add_argument("prompt", nargs="+")
    # generate / chat pass every sampling value themselves (greedy unless --temperature): the
    # checkpoint's generation-config defaults apply nowhere, so a bad one is no error here
    g.set_defaults(func=cmd_generate, generation_config="vllm")

    c = sub.add_parser("chat", help="interactive chat (streams tokens)")
    _add_engine_options(c)
    _add_xla_cache_option(c)
    _add_sampling_options(c, max_tokens=256)
    c.add_argument("--system", default=None, help="system prompt")
    c.set_defaults(func=cmd_chat, generation_config="vllm")  # as generate's

    v = sub.add_parser("convert", help="convert a GGUF / HF checkpoint to an orbax checkpoint")
    v.add_argument("--model", default=DEFAULT_MODEL)
    v.add_argument("--output", default=None, help="directory (default: the checkpoint cache)")
    v.add_argument("--quantization", choices=["fp8"], default=None,
                   help="store the projections quantized to FP8 (e4m3 + float32 scales, as "
                        "--quantization fp8 quantizes them on load)")
    v.add_argument("--calibration", default=None, metavar="TEXT_FILE",
                   help="with --quantization fp8 and --output: choose each e4m3 value by "
                        "GPTQ on this text (same format and scales; load with LLM(output))")
    v.add_argument("--calibration-tokens", type=_at_least_2, default=4096,
                   help="tokens of the calibration text used, >= 2 (default: %(default)s)")
    v.set_defaults(func=cmd_convert)

    add_compile_command(sub)
    from jaxinfer.serving.cli import add_serving_commands  # serve, client

    add_serving_commands(sub)
    from jaxinfer.bench.cli import add_bench_command  # bench offline | serve | latency

    add_bench_command(sub)
    return parser


def main(argv: Seq[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    if hasattr(ns, "load_format") and hasattr(ns, "model"):
        ns.model = model_spec(ns.model, ns.load_format)
    # transformers announces at import that torch is absent: jaxinfer never needs torch.
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    warnings.formatwarning = lambda msg, cat, *a, **k: f"jaxinfer: warning: {msg}\n"
    logging.basicConfig(level=logging.INFO if getattr(ns, "verbose", False) else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return ns.func(ns)
    except KeyboardInterrupt:
        return 130
    except (ValueError, FileNotFoundError, OSError) as e:
        # ConfigError, ParameterError, RequestError, CheckpointError, WeightError are
        # ValueErrors: one line, no traceback.
        _close_progress_bars()
        print(f"jaxinfer: error: {e}", file=sys.stderr)
        return 2


def _close_progress_bars() -> None:
    """Close the progress bars an error left open (a loader's "load X: 40%|..."), so the
    error line starts a line of its own instead of ending the bar's."""
    std = sys.modules.get("tqdm.std")  # tqdm not imported: no bar to close
    for bar in list(getattr(getattr(std, "tqdm", None), "_instances", ())):
        bar.close()


if __name__ == "__main__":
    sys.exit(main())
