"""The command line's shared options: the engine's (``generate``, ``chat``, ``compile``,
``serve``, ``bench``), sampling's, the XLA cache's, and the argparse types they use; the
commands themselves are in ``jaxinfer.cli``."""

from __future__ import annotations

import argparse

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
                        "$JAXINFER_XLA_CACHE_DIR, else $XDG_CACHE_HOME/jaxinfer/xla or "
                        "~/.cache/jaxinfer/xla)")


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
