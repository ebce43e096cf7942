"""``jaxinfer compile``: the command's parser, its configuration header and bucket table
(the compilation itself is :mod:`jaxinfer.compile`)."""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from typing import TYPE_CHECKING, Any

import numpy as np

from jaxinfer.compile import (
    MODES,
    compile_bucket_set,
    enumerate_programs,
    kv_pool_bytes,
    model_config_of,
)
from jaxinfer.compile_pool import CompilePool, PhaseLog, default_jobs
from jaxinfer.config import EngineConfig, ModelConfig
from jaxinfer.sampling_defaults import check_sampling_defaults

if TYPE_CHECKING:
    from jaxinfer.compile_cache import Program

# JAX is imported inside the functions: `jaxinfer --help` builds this parser and stays light.


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def describe(model: str, mc: ModelConfig, ec: EngineConfig, programs: list[Program],
             sizing: Any = None) -> str:
    """Header of ``jaxinfer compile``: model, KV pool memory (with ``sizing``, a
    ``kv_sizing.KVSizing``: how its page count was chosen) and program counts."""
    from jaxinfer.engine_config import _resolve_dtype
    from jaxinfer.kv_sizing import kv_scale_bytes, resolve_kv_dtype
    from jaxinfer.layers.attention import get_backend
    from jaxinfer.models.params import param_shapes

    dtype = np.dtype(_resolve_dtype(ec.dtype))
    kv_dtype = resolve_kv_dtype(ec.kv_cache_dtype, dtype)
    kv = kv_pool_bytes(mc, ec, dtype)
    scales = kv_scale_bytes(mc, kv_dtype)
    n_params = sum(math.prod(s) for s in param_shapes(mc).values())
    from jaxinfer.runner import SAMPLER

    counts: dict[str, int] = {}
    rows: dict[str, set[int]] = {}  # sampler variant -> its row counts
    for p in programs:
        key = p.mode if p.bucket.kind == p.mode else f"{p.bucket.kind} {p.mode}"
        if p.mode == SAMPLER:  # one count for all variants
            key = SAMPLER
            rows.setdefault(p.bucket.kind, set()).add(p.bucket.num_seqs)
        counts[key] = counts.get(key, 0) + 1
    lines = [
        (f"model {model}: {mc.num_layers} layers, {mc.num_kv_heads} KV heads x {mc.head_dim}, "
         f"{n_params / 1e6:,.1f} M params ({_gib(n_params * dtype.itemsize)} in {dtype.name})"),
        (f"engine: max_model_len {ec.max_model_len}, max_num_seqs {ec.max_num_seqs}, "
         f"max_num_batched_tokens {ec.max_num_batched_tokens}, attention "
         f"{get_backend(ec.attention_backend).name}, dtype {dtype.name}"),
        (f"buckets: decode {list(ec.decode_buckets)}, prefill tokens "
         f"{list(ec.prefill_buckets)}, prefill seqs {list(ec.prefill_seq_buckets)}, "
         f"pages {list(ec.page_buckets)}"),
        (f"KV pool ({kv_dtype.name}): {ec.total_kv_pages} pages x {ec.block_size} tokens; "
         f"2 x L {mc.num_layers} x Hkv {mc.num_kv_heads} x {ec.total_kv_pages} x "
         f"{ec.block_size} x D {mc.head_dim} x {kv_dtype.itemsize} B"
         + (f" + {scales} B scales" if scales else "") + f" = {kv:,} bytes ({_gib(kv)})"),
        *([f"KV pool sizing: {sizing.describe(ec.max_model_len)}"] if sizing else []),
        f"programs: {len(programs)} (" + ", ".join(f"{k} {v}" for k, v in counts.items()) + ")",
    ]
    if rows:
        lines.append("sampling variants x rows: " + ", ".join(
            f"{name} {sorted(r)}" for name, r in rows.items()))
    return "\n".join(lines)


def bucket_table(programs: list[Program], seconds: dict[Program, float] | None = None) -> str:
    """One line per (mode, kind, tokens, seqs) with its page buckets (and compile seconds)."""
    rows: dict[tuple[str, str, int, int], list[Program]] = {}
    for p in programs:
        b = p.bucket
        rows.setdefault((p.mode, b.kind, b.num_tokens, b.num_seqs), []).append(p)
    wm = max([4] + [len(k[0]) for k in rows])  # column widths: the longest mode / kind
    wk = max([4] + [len(k[1]) for k in rows])
    lines = [f"{'mode':{wm}} {'kind':{wk}} {'tokens':>6} {'seqs':>5}  pages"
             + ("  (compile seconds)" if seconds is not None else "")]
    for (mode, kind, T, S), ps in rows.items():
        cells = [str(p.bucket.max_pages) + (f" ({seconds[p]:.2f})" if seconds and p in seconds
                                            else "") for p in ps]
        lines.append(f"{mode:{wm}} {kind:{wk}} {T:>6} {S:>5}  " + "  ".join(cells))
    return "\n".join(lines)


def add_compile_command(sub: Any) -> None:
    """Register ``jaxinfer compile`` on the CLI's subparsers (called by cli.build_parser)."""
    from jaxinfer import cli

    p = sub.add_parser(
        "compile", help="compile every bucket of a configuration ahead of time into "
                        "--cache-dir (start-ups then compile nothing)",
        description="Compile every program of a configuration into --cache-dir. The KV "
                    "pool's page count is part of every program: --num-kv-pages, else the "
                    "pool an engine would size on this device (GPU: "
                    "--gpu-memory-utilization of XLA's memory limit less the weights, "
                    "computed from the parameter shapes, and the largest buckets' "
                    "activations; CPU: max_num_seqs x max_model_len, capped by available "
                    "RAM), at most max_num_seqs x max_model_len. An engine started with the "
                    "cache adopts it.")
    cli._add_engine_options(p, compile_cmd=True)
    p.add_argument("--list", action="store_true",
                   help="print the bucket table and the KV memory it implies; compile nothing")
    p.add_argument("--modes", default=",".join(MODES),
                   help="program modes to compile (default: %(default)s; 'logits' serves "
                        "prompt_logits only)")
    p.add_argument("--jobs", type=int, default=default_jobs(),
                   help="worker processes (default: %(default)s)")
    p.add_argument("--force", action="store_true", help="recompile programs already cached")
    p.add_argument("--generation-config", choices=["auto", "vllm"], default="auto",
                   help="auto: with --num-scheduler-steps, also the K-step programs of the "
                        "checkpoint's default sampling params (generation_config.json), which "
                        "a server with the same option builds at its warm-up; vllm: not")
    p.set_defaults(func=cmd_compile)


def cmd_compile(ns: Any) -> int:
    """``jaxinfer compile``: print the configuration; with ``--list`` the bucket table, else
    compile into ``--cache-dir`` and print per-program seconds. With ``--jobs`` > 1 the
    workers start first and import JAX while this process reads the configuration. Logs its
    phases at INFO (``-v``). Raises ConfigError, CheckpointError (one-line CLI errors)."""
    from jaxinfer.config import ConfigError

    if not ns.cache_dir and not ns.list:  # before the configuration is read and printed
        raise ConfigError("jaxinfer compile needs --cache-dir DIR (or --list)")
    if ns.jobs < 1:
        raise ConfigError(f"--jobs must be at least 1, got {ns.jobs}")
    modes = [m.strip() for m in ns.modes.split(",") if m.strip()]
    if not modes:  # it wrote a cache of no programs, which engines then took as theirs
        raise ConfigError(f"--modes names no program mode (got {ns.modes!r}); use "
                          f"{', '.join(MODES)}")
    phases = PhaseLog()
    phases.mark("command parsed")
    # This process only compiles (its workers too): keep it from reserving accelerator memory.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    pool = None
    if ns.jobs > 1 and ns.cache_dir and not ns.list:
        # Workers import JAX while this process reads the configuration; as many as spare
        # cores allow before the program count (and so the workers needed) is known.
        pool = CompilePool(ns.jobs, phases, start=max(1, (os.cpu_count() or 2) - 2))
    try:
        from jaxinfer import cli
        from jaxinfer.compile_cache import MANIFEST
        from jaxinfer.engine_config import engine_config_for

        args = cli._engine_args(ns)
        args.pop("compile_cache_dir", None)
        args.pop("compile_cache_strict", None)
        args.pop("generation_config", None)  # an engine option, not an EngineConfig field
        mc = model_config_of(ns.model)
        defaults = mc.sampling_defaults if ns.generation_config == "auto" else {}
        check_sampling_defaults(defaults, ns.model)  # as the engine would refuse them
        phases.mark("model config")
        ec = engine_config_for(mc, args)
        # The pool's shape is part of every program, so a compile cache fixes it; an engine
        # started with the cache adopts it (LLMEngine). Without --num-kv-pages: the pool that
        # engine would size from this device's memory, at most total_kv_pages (compile_kv).
        from jaxinfer.compile_kv import size_for_compile

        sizing = size_for_compile(mc, ec)
        ec = dataclasses.replace(ec, num_kv_pages=sizing.num_pages)
        phases.mark("KV pool sized")
        from jaxinfer.runner_multi import warm_variants

        programs = enumerate_programs(ec, modes, warm_variants(defaults, mc.vocab_size))
        print(describe(ns.model, mc, ec, programs, sizing), flush=True)
        phases.mark("configuration described")
        if ns.list:
            print(bucket_table(programs))
            return 0
        r = compile_bucket_set(mc, ec, programs, ns.cache_dir, jobs=ns.jobs, force=ns.force,
                               pool=pool, phases=phases)
    finally:
        if pool is not None:
            pool.close()
    print(bucket_table(programs, r.seconds))
    done = list(r.seconds.values())
    print(f"compiled {len(done)} programs, {len(r.skipped)} already cached; "
          f"{sum(done):.1f} s of compile time, max {max(done, default=0):.2f} s; "
          f"wall {r.wall_seconds:.1f} s; "
          f"manifest {r.directory / MANIFEST}", file=sys.stderr)
    phases.mark("done")
    return 0
