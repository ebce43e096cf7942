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

from jaxinfer.bench.cli import (  # argparse types (no JAX)
    add_structured_output_flags,
    logit_bias_json,
    structured_from_flags,
    token_id_list,
)

DEFAULT_MODEL = "smollm2-135m"


def _engine_args(ns: argparse.Namespace) -> dict:
    args = {"block_size": ns.block_size, "dtype": ns.dtype,
            "attention_backend": ns.attention_backend, "seed": ns.seed}
    if ns.max_model_len is not None:
        args["max_model_len"] = ns.max_model_len
    for name in ("max_num_seqs", "max_num_batched_tokens", "max_prefill_seqs", "num_kv_pages",
                 "decode_buckets", "prefill_buckets", "page_buckets", "prefill_seq_buckets",
                 "quantization", "kv_cache_dtype", "matmul_backend", "gpu_memory_utilization",
                 "num_scheduler_steps"):  # None: the engine's default (engine_config_for)
        if getattr(ns, name) is not None:
            args[name] = getattr(ns, name)
    if getattr(ns, "async_scheduling", None) is not None:
        args["async_scheduling"] = ns.async_scheduling
    if getattr(ns, "jump_forward", False):
        args["jump_forward"] = True
    if ns.scan_layers is not None:
        args["scan_layers"] = ns.scan_layers == "true"
    if getattr(ns, "generation_config", "auto") != "auto":  # "auto": the engine's default
        args["generation_config"] = ns.generation_config
    if ns.cache_dir:
        args["compile_cache_dir"] = ns.cache_dir
        args["compile_cache_strict"] = getattr(ns, "strict", False)
    return args


def _add_xla_cache_option(p: argparse.ArgumentParser) -> None:
    """``--xla-cache-dir`` for the commands that build an engine to run it (generate, chat,
    serve): JAX's persistent compilation cache, on by default (jaxinfer/xla_cache.py)."""
    p.add_argument("--xla-cache-dir", default=None, metavar="DIR",
                   help="JAX's persistent compilation cache: programs compiled once are "
                        "reused at the next start ('off' turns it off; default "
                        "$JAXINFER_XLA_CACHE_DIR, else ~/.cache/jaxinfer/xla)")


def _xla_cache(ns: argparse.Namespace) -> None:
    from jaxinfer.xla_cache import enable

    enable(ns.xla_cache_dir)


def _ints(text: str) -> tuple[int, ...]:
    """``"1,2,4"`` -> (1, 2, 4), for the bucket-set and bench list options.

    Raises argparse.ArgumentTypeError naming the bad item, an empty one too (``16,,32`` or
    ``16,`` is a typo, not a shorter list).
    """
    vals = []
    for i, v in enumerate(text.split(","), 1):
        why = "is empty" if not v.strip() else f"({v.strip()!r}) is not an integer"
        try:
            vals.append(int(v))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated integers, got "
                                             f"{text!r}: item {i} {why}") from None
    return tuple(vals)


def _add_engine_options(p: argparse.ArgumentParser, compile_cmd: bool = False) -> None:
    """The engine's options on ``p``; ``compile_cmd``: for ``jaxinfer compile``, which writes
    the compile cache (``--cache-dir`` is its output; no ``--strict``)."""
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="named model (smollm2-135m, gemma3-270m), .gguf file, HF directory, "
                        "converted checkpoint or dummy:<shape> (default: %(default)s)")
    p.add_argument("--load-format", choices=["auto", "dummy"], default="auto",
                   help="dummy: random weights at --model's shape (a dummy shape such as "
                        "llama-3.1-8b, or any model whose config can be read), as vLLM's "
                        "--load-format dummy")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + output in tokens (default: min(2048, model's))")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV page")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="sequences running at once (default: 256 on a GPU, 8 on the CPU)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="weights, activations and KV cache (auto: float32 on CPU, else bf16)")
    p.add_argument("--attention-backend", default="auto",
                   choices=["auto", "reference", "pallas", "pallas_decode", "pallas_mgpu"],
                   help="auto: pallas_mgpu on Hopper GPUs, pallas on other GPUs, reference "
                        "elsewhere; pallas: the Triton decode and prefill kernels; pallas_mgpu: "
                        "pallas with the Mosaic GPU prefill kernel (prefill_mgpu.py) for "
                        "prefill buckets of >= 2048 tokens")
    p.add_argument("--scan-layers", choices=["true", "false"], default=None,
                   help="run the layers under lax.scan (compile time independent of depth; "
                        "default: unrolled, faster steps)")
    p.add_argument("--quantization", choices=["fp8"], default=None,
                   help="quantize the projection weights on load (FP8 e4m3, per channel; "
                        "reads a copy made by `jaxinfer convert --quantization fp8` if cached)")
    p.add_argument("--matmul-backend", choices=["auto", "xla", "pallas"], default=None,
                   help="GEMMs of FP8 projections: auto = the Pallas kernels on GPU (W8A8 at "
                        "decode and prefill sizes), XLA elsewhere; bf16 GEMMs always run XLA")
    p.add_argument("--kv-cache-dtype", choices=["auto", "fp8", "fp8_e4m3"], default=None,
                   help="KV cache dtype: auto = the model dtype; fp8 / fp8_e4m3 = e4m3 with "
                        "per-layer scales (half the bytes: twice the tokens of bf16)")
    p.add_argument("--seed", type=int, default=0,
                   help="engine seed: draws the sampling seeds of requests without their own")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="overlap host scheduling with the device: decode steps dispatched one "
                        "ahead, tokens read back one step late (outputs unchanged; default on, "
                        "--no-async-scheduling for the synchronous engine)")
    p.add_argument("--num-scheduler-steps", type=int, default=None, metavar="K",
                   help="decode steps per compiled program when every running sequence "
                        "decodes (vLLM's multi-step scheduling: host cost paid once per K "
                        "tokens; outputs unchanged, streamed K tokens at a time; default 1)")
    p.add_argument("--jump-forward", action="store_true",
                   help="jump-forward decoding of structured outputs: tokens a grammar forces "
                        "are appended unsampled and computed by one prefill step (pays at "
                        "small batches; see EngineConfig.jump_forward)")
    b = p.add_argument_group("buckets (README 'Buckets'; defaults derive from the limits)")
    b.add_argument("--max-num-batched-tokens", type=int,
                   help="most tokens in a prefill step (default: 8192 on a GPU, 512 on the CPU)")
    b.add_argument("--max-prefill-seqs", type=int,
                   help="most sequences in a prefill step (default: 64 on a GPU, 8 on the CPU)")
    b.add_argument("--gpu-memory-utilization", type=float,
                   help="fraction (0, 1] of XLA's device memory limit (CPU: available RAM) "
                        "for weights, activations and the KV pool when --num-kv-pages is "
                        "not given (default 0.9, vLLM's)")
    b.add_argument("--num-kv-pages", type=int,
                   help="KV pool pages, the null page included (default: sized from device "
                        "memory on a GPU, --gpu-memory-utilization; on the CPU max_num_seqs "
                        "full-length sequences, capped by RAM; `jaxinfer compile` caps either "
                        "at max_num_seqs full-length sequences)")
    b.add_argument("--decode-buckets", type=_ints, help="batch sizes, e.g. 1,2,4,8")
    b.add_argument("--prefill-buckets", type=_ints, help="packed token counts, e.g. 16,64,512")
    b.add_argument("--page-buckets", type=_ints, help="block-table widths in pages")
    b.add_argument("--prefill-seq-buckets", type=_ints,
                   help="sequence rows of the prefill programs")
    if compile_cmd:
        p.add_argument("--cache-dir", "--compile-cache-dir", dest="cache_dir", default=None,
                       help="compile cache to write (created if missing; programs of the same "
                            "configuration already in it are kept unless --force)")
    else:
        p.add_argument("--cache-dir", "--compile-cache-dir", dest="cache_dir", default=None,
                       help="compile cache written by `jaxinfer compile`: load programs from it")
        p.add_argument("--strict", action="store_true",
                       help="refuse a compile cache that does not match this configuration")
    p.add_argument("-v", "--verbose", action="store_true", help="log engine events")


def model_spec(model: str, load_format: str = "auto") -> str:
    """The ``load_model`` source for ``--model`` / ``--load-format``: with ``dummy``, the
    ``dummy:`` form (``llama-3.1-8b`` -> ``dummy:llama-3.1-8b``; a path or named model ->
    random weights at its shape)."""
    if load_format == "dummy" and not model.startswith("dummy:"):
        return f"dummy:{model}"
    return model


def _sampling(ns: argparse.Namespace):
    from jaxinfer.sampling_params import SamplingParams

    return SamplingParams(temperature=ns.temperature, top_k=ns.top_k, top_p=ns.top_p,
                          max_tokens=(ns.max_tokens if ns.max_tokens is not None
                                      else ns.default_max_tokens),
                          seed=ns.sample_seed, min_tokens=ns.min_tokens, n=ns.n,
                          ignore_eos=ns.ignore_eos, stop_token_ids=ns.stop_token_ids,
                          logit_bias=ns.logit_bias, bad_words=ns.bad_words,
                          structured_outputs=structured_from_flags(ns))


def _fit_max_tokens(ns: argparse.Namespace, params, prompt_len: int, max_model_len: int):
    """``chat``'s params for a prompt of ``prompt_len`` tokens: without ``--max-tokens``, the
    default capped to the room ``max_model_len`` leaves (``prompts.fit_max_tokens``; vLLM's
    OpenAI server does alike); an explicit ``--max-tokens`` is kept, and the engine's
    add_request refuses it if it does not fit. (``generate`` needs none of this:
    ``LLM.generate`` caps any max_tokens at max_model_len, as vLLM's offline LLM.)"""
    from jaxinfer.prompts import fit_max_tokens

    return params if ns.max_tokens is not None else fit_max_tokens(params, prompt_len,
                                                                   max_model_len)


def _add_sampling_options(p: argparse.ArgumentParser, max_tokens: int) -> None:
    p.add_argument("--max-tokens", type=int, default=None,
                   help=f"most new tokens per prompt (default: {max_tokens}, or the room "
                        f"left in --max-model-len if less)")
    p.set_defaults(default_max_tokens=max_tokens)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--sample-seed", type=int, default=None, help="per-request sampling seed")
    p.add_argument("--n", type=int, default=1, dest="n",
                   help="samples per prompt (vLLM's n; sample i draws with seed + i)")
    p.add_argument("--min-tokens", type=int, default=0,
                   help="EOS and stop token ids are masked until this many new tokens")
    p.add_argument("--ignore-eos", action="store_true", help="generate past EOS")
    p.add_argument("--stop-token-ids", type=token_id_list, default=[],
                   help="comma-separated token ids that end the output")
    p.add_argument("--logit-bias", type=logit_bias_json, default=None,
                   help='JSON token id -> bias added to its logit, e.g. \'{"13": -100}\'')
    p.add_argument("--bad-words", action="append", default=None, metavar="WORD",
                   help="a word never generated (vLLM's bad_words; repeat the flag for more)")
    add_structured_output_flags(p)


def _token_ids(text: str) -> list[int]:
    """``--token-ids`` prompt: integers separated by spaces or commas."""
    try:
        return [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise ValueError(f"--token-ids: prompt {text!r} is not a list of integers") from None


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
