"""Warm-up: build the programs every request needs before a server says SERVING.

:func:`warm_up` runs one short greedy request and builds the decode program of every batch
bucket (with its sampler variants), the page-copy program and, under multi-step scheduling,
the common k-step programs. The decode programs are built by a pool of threads while the
request runs in the calling thread: tracing and lowering are Python and take turns on the
GIL, but XLA's compile releases it, so on a GPU host several programs compile at once (the
runner builds each program once, also when two threads ask for it; runner.py). This is how
vLLM's start-up captures a CUDA graph per batch size before serving, and what
``jaxinfer compile`` does ahead of time with worker processes (compile.py).
"""

from __future__ import annotations

import gc
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import jax

from jaxinfer.sampling_params import SamplingParams

if TYPE_CHECKING:
    from jaxinfer.engine import LLMEngine


def resolve_warmup(warmup: bool | str) -> bool | str:
    """What a server's ``warmup`` setting builds: ``False`` nothing, ``True`` the decode
    programs (:func:`warm_up`), ``"prefill"`` those and every prefill program, ``"auto"`` (the
    default) ``"prefill"`` on a GPU backend and ``True`` on the CPU, where the reference
    attention's grid of prefill programs is much larger (95 for SmolLM2's CPU defaults vs 10
    at the GPU defaults). On an H100, Llama-3.1-8B at the GPU defaults with 8 threads: 121
    programs in 120 s with the prefill ones, 110 in 85 s without (benchmarks/RESULTS.md
    "Start-up (H100, sessions 38-39)").

    Raises:
      ValueError: any other value (``config.ConfigError`` is a ValueError; the server raises
        that).
    """
    if warmup is not True and warmup is not False and warmup not in ("prefill", "auto"):
        raise ValueError(f"warmup must be True, False, 'prefill' or 'auto', got {warmup!r}")
    if warmup == "auto":
        return "prefill" if jax.default_backend() != "cpu" else True
    return warmup


def default_warmup_jobs() -> int:
    """Threads that build programs in :func:`warm_up`: 1 on the CPU (XLA:CPU already spreads
    one compile over the cores, and a laptop's memory is the limit), else half the cores,
    1 to 8 (``compile_pool.default_jobs``, as ``jaxinfer compile --jobs``)."""
    from jaxinfer.compile_pool import default_jobs

    return 1 if jax.default_backend() == "cpu" else default_jobs()


def warm_up_builds(engine: LLMEngine, decode_buckets: bool = True,
                   prefill_buckets: bool = False) -> list[Any]:
    """The builds :func:`warm_up` runs beside its request, as zero-argument callables: with
    ``decode_buckets`` the decode program of every batch bucket at the narrowest block
    table (each with its row count's sampler variants), its token-gather program under
    async scheduling, the k-step programs of ``runner_multi.warm_variants`` (greedy,
    temperature-only and the engine's default sampling params' variant) when
    ``num_scheduler_steps`` > 1, the page-copy program of ``n > 1`` requests and the
    loaders of a slot's penalty history and logit_bias / bad_words tables and of
    structured-outputs rows' masks (one per decode batch bucket); with
    ``prefill_buckets`` every reachable prefill program of the sample mode
    (``compile.enumerate_programs``; prompt_logprobs' logits programs stay on first use).
    The largest programs (the slowest to compile) come first."""
    from functools import partial

    from jaxinfer.batch import Bucket
    from jaxinfer.compile import enumerate_programs
    from jaxinfer.runner import COPY, GATHER, SAMPLE, gather_bucket
    from jaxinfer.runner_multi import warm_variants
    from jaxinfer.runner_slots import BIAS, BIAS_BUCKET, HISTORY, MASK, mask_bucket

    ec, runner = engine.config, engine.runner
    variants = warm_variants(engine.sampling_defaults, engine.model_config.vocab_size)
    builds: list[Any] = []
    if prefill_buckets:
        prefills = [p.bucket for p in enumerate_programs(ec, ["sample"])
                    if p.bucket.kind == "prefill"]
        builds += [partial(runner.executable, b, SAMPLE)
                   for b in sorted(prefills, key=lambda b: -b.num_tokens)]
    if not decode_buckets:
        return builds
    for b in sorted(ec.decode_buckets, reverse=True):  # the largest (slowest) first
        bucket = Bucket("decode", b, b, ec.page_buckets[0])
        builds.append(partial(runner.executable, bucket))
        if ec.async_scheduling:  # a pipelined step's input tokens (engine_async.py)
            builds.append(partial(runner.executable, gather_bucket(b), GATHER))
        if ec.num_scheduler_steps > 1:
            builds += [partial(engine.multi_step_programs.executable, bucket, v,
                               ec.num_scheduler_steps) for v in variants]
    builds.append(partial(runner.executable, runner.copy_bucket, COPY))
    # The loaders of a slot's sampling state, run when a request with penalties, min_tokens,
    # allowed_token_ids (history) or a logit_bias / bad_words (bias) is admitted.
    builds += [partial(runner.executable, Bucket(HISTORY, ec.max_model_len, 1, 0), HISTORY),
               partial(runner.executable, BIAS_BUCKET, BIAS)]
    # and, before each step that samples rows with structured_outputs, their grammar masks
    builds += [partial(runner.executable, mask_bucket(b), MASK) for b in ec.decode_buckets]
    return builds


def warm_up(engine: LLMEngine, decode_buckets: bool = True, jobs: int | None = None,
            prefill_buckets: bool = False) -> float:
    """Build what requests need before serving; returns the seconds spent.

    With a compile cache (``serve --cache-dir``) every precompiled program is loaded first.
    Then one 8-token greedy request runs to its second token (the smallest prefill bucket
    and the B=1 decode program) while ``jobs`` threads (default
    :func:`default_warmup_jobs`) build :func:`warm_up_builds`: the decode programs and,
    with ``prefill_buckets`` (``serve --warmup-prefill``), every prefill program, so that no
    prompt later stalls the running streams while its bucket compiles (10 programs at the
    GPU defaults with the Pallas kernels; the jnp reference's grid of rows x widths is
    larger: 95 for SmolLM2's CPU defaults). Each sample program comes with the sampler
    programs of its row count, every variant (runner.py), so no sampling parameters compile
    anything later; what is left compiles on first use (``runner.num_compilations`` counts
    it): prefill programs of other token counts, prompt_logprobs' logits programs, the
    k-step programs of other sampler variants (built in the background while their windows
    run as one step: engine_multi.py). A model with a tokenizer also builds llguidance's
    tokenizer for structured outputs (else the first such request would, seconds at a large
    vocabulary, holding up the running streams). Raises ValueError for
    ``jobs`` < 1; a build's error (out of memory, say) is raised once the request and the
    other builds are done.
    """
    from jaxinfer.compile import preload

    jobs = default_warmup_jobs() if jobs is None else jobs
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"warm-up jobs must be an integer >= 1, got {jobs!r}")
    t0 = time.perf_counter()
    preload(engine)  # with a compile cache: no request waits for a program later
    builds = warm_up_builds(engine, decode_buckets, prefill_buckets)
    if engine.tokenizer is not None and decode_buckets:  # structured outputs' tokenizer
        builds.append(engine.structured.ll_tokenizer)  # (Gemma 3's 262k tokens: ~4 s)
    ec, V = engine.config, engine.model_config.vocab_size
    n = max(1, min(8, ec.max_model_len - 2))
    with ThreadPoolExecutor(max(1, min(jobs, len(builds))),
                            thread_name_prefix="jaxinfer-warmup") as pool:
        pending = [pool.submit(build) for build in builds] if jobs > 1 else []
        rid = engine.add_request([(i + 1) % V for i in range(n)],
                                 SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
        while engine.scheduler.get(rid) is not None:
            engine.step()
        for f in pending:
            f.result()
    if jobs == 1:
        for build in builds:
            build()
    return time.perf_counter() - t0


def freeze_gc_heap() -> int:
    """After the warm-up: collect, then move every object alive into the garbage collector's
    permanent generation (``gc.freeze``), so later collections skip them; returns how many
    were frozen. vLLM's ``vllm.utils.gc_utils.freeze_gc_heap``, called after its warm-up.

    Why: a full collection walks every tracked object, and a warmed-up engine holds a million
    or so (weights' wrappers, jaxprs, executables' Python objects); it holds the GIL
    throughout, so the engine's thread stops for as long. Tracing a program allocates fast
    enough to set one off: a background build of SmolLM2's 8-step program kept the engine's
    thread from the GIL for up to 99-122 ms (a collection), 31-33 ms with the heap frozen
    (benchmarks/background_build_gil.py; RESULTS.md "Multi-step decode: a new sampler
    variant after the warm-up"; on an H100's 8B FP8 run the stall with and without the freeze
    was within the rounds' spread: what is left there is the GIL's hand-back,
    runner_multi.BACKGROUND_SWITCH_INTERVAL_S). Objects made later are still collected;
    frozen ones are not, until :func:`unfreeze_gc_heap`.
    """
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def unfreeze_gc_heap() -> None:
    """Undo :func:`freeze_gc_heap` (a stopped server's engine can then be collected)."""
    gc.unfreeze()
