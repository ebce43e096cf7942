"""Ahead-of-time compilation of a configuration's bucket set (``jaxinfer compile``).

Every device program the engine can run has a fixed shape (a bucket, see ``batch.Bucket``) and
a mode (``"sample"`` or ``"logits"``; a sample step also runs a ``"sampler"`` program, see
``runner.py``). :func:`enumerate_programs` lists them for an
:class:`EngineConfig`; :func:`compile_bucket_set` compiles each from abstract shapes (no
weights are read or allocated, so 70B-shaped programs compile on a small host) into a compile
cache directory (see :mod:`jaxinfer.compile_cache`). A later start with the same configuration
and ``compile_cache_dir`` loads the programs instead of tracing and compiling them
(:func:`attach_program_store`). The command's parser and printing: :mod:`jaxinfer.compile_cli`.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jaxinfer.batch import Bucket
from jaxinfer.config import EngineConfig, ModelConfig

if TYPE_CHECKING:
    from jaxinfer.compile_cache import Program

# JAX is imported inside the functions: `jaxinfer --help` builds this parser and stays light.

log = logging.getLogger(__name__)

# The worker pool and phase log live in compile_pool (host-only process plumbing).
from jaxinfer.compile_pool import (  # noqa: E402,F401 - re-exported for callers and tests
    CompilePool,
    PhaseLog,
    _compile_program,
    _worker_compile,
    _worker_setup,
    default_jobs,
    process_start_time,
)

MODES = ("sample", "logits")  # runner.SAMPLE, runner.LOGITS (tested equal)


def _reachable_prefill(T_prev: int, S: int, P: int, ec: EngineConfig) -> bool:
    """Whether a prefill step can land in bucket (T, S, P), T the bucket above ``T_prev``.

    A step in this bucket packs n > T_prev tokens into at most S rows, so some row holds at
    least ceil(n / S) tokens and needs ceil(that / page_size) pages; rows are at most
    max_model_len tokens. Pruning only what no step can reach keeps the set exact.
    """
    longest = -(-(T_prev + 1) // S)
    return longest <= ec.max_model_len and -(-longest // ec.block_size) <= P


def enumerate_programs(ec: EngineConfig, modes: Iterable[str] = MODES,
                       multi_step_variants: Iterable[str] | None = None) -> list[Program]:
    """Every program the engine can run under ``ec``, in the order build_step picks buckets.

    Prefill ("sample"): T in ``prefill_buckets`` x S in ``prefill_seq_buckets`` x pages in
    ``page_buckets``; prefill ("logits", used by ``prompt_logits``): the same with
    S = 1; decode ("sample" only): S = T in ``decode_buckets`` x pages; with "sample" also
    the page-copy program of ``n > 1`` requests (mode "copy", Bucket("kv", max_num_seqs, 1,
    0), the runner's ``copy_bucket``), the penalty-history program (mode "history",
    Bucket("history", max_model_len, 1, 0): the engine pads a sequence's tokens to
    max_model_len for ``runner.load_history``), the logit-bias program (mode "bias",
    ``runner.BIAS_BUCKET``: ``runner.load_logit_bias``), the structured-outputs mask
    loaders (mode "mask", ``runner_slots.mask_bucket(B)`` for every decode batch bucket B:
    ``runner.load_allowed_masks``) and the sampler programs (mode "sampler",
    ``sampling.sampler_bucket(S, variant)``): every variant of
    ``sampling.SAMPLER_VARIANTS`` for every row count S of the sample programs, and the
    token-gather program of async scheduling (mode "gather", ``runner.gather_bucket(B)``)
    for every decode batch bucket B; with ``num_scheduler_steps`` k > 1, the k-step decode
    programs (mode "multistep", ``runner_multi.multi_step_bucket``) of every decode bucket for
    each of ``multi_step_variants`` (default ``runner_multi.MULTI_STEP_WARM_VARIANTS``;
    ``runner_multi.warm_variants`` adds the model's default one). Buckets no step can
    reach are left out: more rows than tokens or than running sequences (the scheduler's
    prefill chunks belong to at most max_num_seqs running sequences), or too few pages for
    the tokens.

    Raises:
      ValueError: for an unknown mode.
    """
    modes = tuple(modes)
    bad = set(modes) - set(MODES)
    if bad:
        raise ValueError(f"unknown program modes {sorted(bad)}; use {', '.join(MODES)}")
    from jaxinfer.compile_cache import Program

    out: list[Program] = []
    for mode in MODES:
        if mode not in modes:
            continue
        seq_buckets = ec.prefill_seq_buckets if mode == "sample" else (1,)
        T_prev = 0
        for T in ec.prefill_buckets:
            S_prev = 0
            for S in seq_buckets:
                if S_prev < min(T, ec.max_num_seqs):  # >= 1 token per row, rows run
                    out += [Program(mode, Bucket("prefill", T, S, P)) for P in ec.page_buckets
                            if _reachable_prefill(T_prev, S, P, ec)]
                S_prev = S
            T_prev = T
    if "sample" in modes:
        out += [Program("sample", Bucket("decode", B, B, P))
                for B in ec.decode_buckets for P in ec.page_buckets]
        out.append(Program("copy", Bucket("kv", max(1, ec.max_num_seqs), 1, 0)))
        out.append(Program("history", Bucket("history", ec.max_model_len, 1, 0)))
        from jaxinfer.runner_slots import BIAS, BIAS_BUCKET, MASK, mask_bucket
        out.append(Program(BIAS, BIAS_BUCKET))
        out += [Program(MASK, mask_bucket(B)) for B in ec.decode_buckets]
        from jaxinfer.runner import SAMPLER
        from jaxinfer.sampling import SAMPLER_VARIANTS, sampler_bucket

        rows = sorted({p.bucket.num_seqs for p in out if p.mode == "sample"})
        from jaxinfer.runner import GATHER, gather_bucket

        out += [Program(GATHER, gather_bucket(B)) for B in ec.decode_buckets]
        out += [Program(SAMPLER, sampler_bucket(S, name)) for S in rows
                for name in SAMPLER_VARIANTS]
        if ec.num_scheduler_steps > 1:
            from jaxinfer.runner_multi import (
                MULTI_STEP,
                MULTI_STEP_WARM_VARIANTS,
                multi_step_bucket,
            )

            variants = tuple(multi_step_variants or MULTI_STEP_WARM_VARIANTS)
            out += [Program(MULTI_STEP, multi_step_bucket(p.bucket, v, ec.num_scheduler_steps))
                    for p in out if p.mode == "sample" and p.bucket.kind == "decode"
                    for v in variants]
    return out


def lower_program(runner: Any, program: Program) -> Any:
    """``program`` traced and lowered on ``runner`` (a ``jax.stages.Lowered``): the runner's
    own programs by ``runner.lower``, multi-step ones by ``runner_multi``."""
    from jaxinfer.runner_multi import MULTI_STEP, MultiStepPrograms, split_multi_step_bucket

    if program.mode == MULTI_STEP:
        return MultiStepPrograms(runner).lower(*split_multi_step_bucket(program.bucket))
    return runner.lower(program.bucket, program.mode)


def kv_pool_bytes(cfg: ModelConfig, ec: EngineConfig, dtype: Any) -> int:
    """Device KV pool size: 2 (K and V) * L * Hkv * pages * page_size * D * KV dtype bytes
    (+ the per-layer scales of an FP8 pool); ``dtype`` is the model dtype, the KV dtype
    follows ``ec.kv_cache_dtype``."""
    from jaxinfer.kv_sizing import kv_page_bytes, kv_scale_bytes, resolve_kv_dtype

    kv = resolve_kv_dtype(ec.kv_cache_dtype, dtype)
    return (ec.total_kv_pages * kv_page_bytes(cfg, ec.block_size, kv)
            + kv_scale_bytes(cfg, kv))


# ----------------------------------------------------------------------------- building
def model_config_of(model: str) -> ModelConfig:
    """A model's config without reading its weights: dummy shapes, the converted copy of a
    named model, else the header of its GGUF file / HF or converted directory
    (``loading.read_header``; every source was loaded in full before). Raises
    CheckpointError."""
    from jaxinfer.loading import NAMED_MODELS, dummy_header, read_header
    from jaxinfer.loading.orbax_store import find_cached, is_converted

    if model.startswith("dummy:"):
        return dummy_header(model[6:])[0]
    path: Path | None = Path(model).expanduser()
    if model in NAMED_MODELS:
        from jaxinfer.loading.named import resolve_named

        path = find_cached(resolve_named(model))
    if path is not None and is_converted(path):
        return ModelConfig.from_json((path / "model_config.json").read_text())
    return read_header(model)[0]


def abstract_runner(model_config: ModelConfig, ec: EngineConfig) -> Any:
    """A ModelRunner over ShapeDtypeStruct weights and KV pool: it lowers and compiles the
    engine's programs for ``ec`` without allocating either (8B/70B shapes on a small host)."""
    from jaxinfer.compile_kv import abstract_net
    from jaxinfer.engine_config import _resolve_dtype
    from jaxinfer.kv_sizing import resolve_kv_dtype
    from jaxinfer.layers.attention import get_backend
    from jaxinfer.runner import ModelRunner

    dtype = _resolve_dtype(ec.dtype)
    net = abstract_net(model_config, ec)
    return ModelRunner(net, num_pages=ec.total_kv_pages, page_size=ec.block_size,
                       attention=get_backend(ec.attention_backend),
                       kv_dtype=resolve_kv_dtype(ec.kv_cache_dtype, dtype),
                       abstract=True, num_slots=ec.max_num_seqs)  # as LLMEngine does


def cached_num_kv_pages(directory: str | Path) -> int | None:
    """The KV pool size (pages) a compile cache was built for, or None if unreadable."""
    try:
        from jaxinfer.compile_cache import MANIFEST

        manifest = json.loads((Path(directory).expanduser() / MANIFEST).read_text())
        pages = manifest["fingerprint"]["engine"]["num_kv_pages"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return pages if isinstance(pages, int) and pages >= 2 else None


def attach_program_store(engine: Any, directory: str | Path, strict: bool = False) -> bool:
    """Make ``engine``'s runner load its programs from the compile cache at ``directory``.

    Programs are deserialized on first use (about 0.1 s each for SmolLM2 on CPU); call
    :func:`preload` to load all of them now. Returns whether the cache matched; a mismatch
    warns (the engine then compiles as usual) or raises CompileCacheError when ``strict``.
    """
    from jaxinfer.compile_cache import ProgramStore, fingerprint

    fp = fingerprint(engine.model_config, engine.config, engine.runner)
    store = ProgramStore.open(directory, fp, strict)
    engine.runner.program_store = store
    if store is not None:
        log.info("compile cache %s: %d programs", store.directory, len(store.entries))
    return store is not None


def preload(engine: Any) -> int:
    """Load every program of the engine's compile cache now; returns how many were loaded."""
    store = engine.runner.program_store
    if store is None:
        return 0
    from jaxinfer.runner_multi import MULTI_STEP, split_multi_step_bucket

    for mode, bucket in list(store.entries):
        if mode == MULTI_STEP:
            engine.multi_step_programs.executable(*split_multi_step_bucket(bucket))
        else:
            engine.runner.executable(bucket, mode)
    return len(store.entries)


# ----------------------------------------------------------------------------- compiling
@dataclass
class CompileReport:
    """What :func:`compile_bucket_set` did: per-program seconds (trace + lower + compile)."""

    directory: Path
    seconds: dict[Program, float]
    skipped: list[Program]
    wall_seconds: float


def compile_bucket_set(model_config: ModelConfig, ec: EngineConfig, programs: list[Program],
                       directory: str | Path, *, jobs: int = 1, force: bool = False,
                       progress: bool = True, pool: CompilePool | None = None,
                       phases: PhaseLog | None = None) -> CompileReport:
    """Compile ``programs`` from abstract shapes into the compile cache at ``directory``.

    Programs already in a cache of the same fingerprint are skipped (all recompiled with
    ``force``). ``jobs`` > 1 compiles in a :class:`CompilePool` of that many workers (``pool``
    if given, started earlier; it is closed on return), whose fingerprint the manifest
    records; so does ``jobs`` = 1 when this process uses JAX's persistent compilation cache,
    whose executables cannot be stored (see :func:`_compile_program`): workers turn it off.
    The manifest is rewritten after every program, so an interrupted run keeps what it
    finished. ``phases`` logs the steps (see :class:`PhaseLog`).
    """
    from tqdm.auto import tqdm

    from jaxinfer.compile_cache import ProgramStore, fingerprint
    from jaxinfer.xla_cache import active_dir

    if jobs < 1:
        raise ValueError(f"jobs must be at least 1, got {jobs}")
    t_start = time.perf_counter()
    phases = pool.phases if pool is not None else phases or PhaseLog()
    persistent = active_dir() is not None  # JAX's persistent cache is on
    if pool is None and programs and (jobs > 1 or persistent):
        pool = CompilePool(min(jobs, len(programs)), phases)
    try:
        if pool is not None:
            fp = pool.setup(model_config, ec, len(programs))
            runner = None
        else:
            runner = abstract_runner(model_config, ec)
            phases.mark("abstract runner")
            fp = fingerprint(model_config, ec, runner)
        phases.mark("fingerprint")
        store = ProgramStore.create(directory, fp, force=force)
        todo = [p for p in programs if (p.mode, p.bucket) not in store.entries]
        skipped = [p for p in programs if (p.mode, p.bucket) in store.entries]
        seconds: dict[Program, float] = {}
        bar = tqdm(total=len(todo), desc="compiling", unit="program", disable=not progress)
        results = (pool.compile(todo) if pool is not None else
                   ((p, _compile_program(runner, p)) for p in todo))
        for p, (blob, s) in results:
            store.save(p, blob, s)
            seconds[p] = s
            bar.set_postfix_str(f"{p.mode} {p.bucket} {s:.1f}s", refresh=False)
            bar.update(1)
            if len(seconds) == 1:
                phases.mark("first compile done")
        bar.close()
        phases.mark("last compile done, manifest written")
    except BaseException:
        if "seconds" in locals():  # the manifest keeps what finished: say so, then fail
            print(f"compile stopped after {len(seconds)} of {len(todo)} programs; the cache at "
                  f"{store.directory} keeps those (a rerun compiles the rest)",
                  file=sys.stderr)
        raise
    finally:
        if pool is not None:
            pool.close()
    return CompileReport(store.directory, seconds, skipped, time.perf_counter() - t_start)
