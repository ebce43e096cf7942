"""Driving an ``LLMEngine`` for ``jaxinfer bench offline`` and ``bench latency``: random
prompts, a warm-up that compiles what a workload needs before it is timed, and a timed run
that records every request's token arrivals.

Only the public engine API is used (``add_request``, ``step``, ``abort_request``,
``RequestOutput``), so the timings are what a caller of the engine sees: a token "arrives"
when ``step()`` returns it.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from jaxinfer.bench.metrics import Progress, RequestTimeline
from jaxinfer.sampling_params import SamplingParams, with_output_kind

WARMUP_SEED_OFFSET = 1_000_003  # warm-up prompts never equal measured ones (prefix cache)


def random_prompts(rng: np.random.Generator, lengths: Sequence[int], vocab_size: int
                   ) -> list[list[int]]:
    """One prompt of uniformly random token ids in [0, vocab_size) per length."""
    return [rng.integers(0, vocab_size, int(n)).tolist() for n in lengths]


HOST_BYTES_PER_TOKEN = 64  # a token id in a Python list (~41 B, measured) + arrival times


def check_host_room(num_prompts: int, tokens_per_prompt: float) -> None:
    """Raise ValueError (a one-line CLI error) when ``num_prompts`` requests of about
    ``tokens_per_prompt`` tokens each (prompt + output) would need more host memory than is
    available, at HOST_BYTES_PER_TOKEN a token: ``--num-prompts 100000000`` used to fill the
    memory generating prompts until the kernel killed the process (exit 137)."""
    from jaxinfer.kv_sizing import host_available_bytes

    need = num_prompts * tokens_per_prompt * HOST_BYTES_PER_TOKEN
    have = host_available_bytes()
    if have is not None and need > have:
        raise ValueError(f"--num-prompts {num_prompts}: {num_prompts} requests of "
                         f"~{tokens_per_prompt:g} tokens need about {need / 2**30:.1f} GiB of "
                         f"host memory for their token ids; {have / 2**30:.1f} GiB is "
                         f"available: run fewer prompts")


def fixed_length_params(output_len: int, temperature: float = 1.0, top_p: float = 1.0,
                        top_k: int = 0, min_p: float = 0.0) -> SamplingParams:
    """Exactly ``output_len`` new tokens (EOS ignored), sampled as vLLM's benchmarks do
    (temperature 1, top-p 1, no top-k / min-p) unless the arguments say otherwise. Raises
    ParameterError (``SamplingParams``) for a value out of its range."""
    return SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                          max_tokens=output_len, ignore_eos=True)


SAMPLING_ARGS = ("temperature", "top_p", "top_k", "min_p")


def add_sampling_args(p: Any) -> None:
    """--temperature / --top-p / --top-k / --min-p (the names of vLLM's ``bench serve``)."""
    p.add_argument("--temperature", type=float, default=1.0,
                   help="sampling temperature (vLLM's benchmarks sample at 1.0; 0 = greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (1 = off)")
    p.add_argument("--top-k", type=int, default=0, help="top-k sampling (0 = off)")
    p.add_argument("--min-p", type=float, default=0.0, help="min-p sampling (0 = off)")


def params_of(ns: Any, output_len: int) -> SamplingParams:
    """:func:`fixed_length_params` from the :func:`add_sampling_args` options of ``ns``."""
    return fixed_length_params(output_len, **sampling_config(ns))


def sampling_config(ns: Any) -> dict[str, Any]:
    """The sampling options of ``ns`` (for the records' ``config``)."""
    return {k: getattr(ns, k) for k in SAMPLING_ARGS}


def page_round(n: int, block_size: int) -> int:
    """``n`` rounded up to a multiple of ``block_size``."""
    return -(-n // block_size) * block_size


@dataclass
class CompileState:
    """The runner's compile counters at one moment."""

    compiled: int
    loaded: int
    seconds: float

    @classmethod
    def of(cls, engine: Any) -> CompileState:
        r = engine.runner
        return cls(r.num_compilations, r.num_loaded, float(sum(r.compile_seconds.values())))

    def since(self, before: CompileState) -> dict[str, Any]:
        return {"programs_compiled": self.compiled - before.compiled,
                "programs_loaded": self.loaded - before.loaded,
                "compile_s": self.seconds - before.seconds}


def build_engine(ns: argparse.Namespace) -> tuple[Any, dict[str, Any]]:
    """``LLMEngine`` from the CLI's engine options; with a compile cache every program in it is
    loaded now. Returns (engine, {"load_s", "preload_s", "programs_preloaded", and the
    engine's start phases as "start_<phase>_s", see ``LLMEngine.start_seconds``})."""
    from jaxinfer.cli_options import _engine_args
    from jaxinfer.compile import preload
    from jaxinfer.engine import LLMEngine

    t0 = time.perf_counter()
    engine = LLMEngine(ns.model, **_engine_args(ns))
    t1 = time.perf_counter()
    n = preload(engine)
    phases = {f"start_{k}_s": v for k, v in getattr(engine, "start_seconds", {}).items()}
    return engine, {"load_s": t1 - t0, "preload_s": time.perf_counter() - t1,
                    "programs_preloaded": n, **phases}


def warm_up(engine: Any, input_len: int, output_len: int, num_seqs: int, seed: int
            ) -> dict[str, Any]:
    """Compile the programs a workload of ``num_seqs`` prompts of ``input_len`` tokens and
    ``output_len`` new tokens, submitted at once, will use, so that its timing excludes them.

    The run goes in waves of ``max_num_seqs`` requests (the last one holds the remainder).
    Prefill: for the first and the last wave's size, that many other random prompts of the
    same length are run to their first token (the scheduler packs them as it will pack the
    measured wave). Decode: the programs of every batch bucket up to the wave's (decode
    steps run between prefill steps while a wave is admitted) at every block-table width the
    contexts ``input_len + 1 .. input_len + output_len`` need, with multi-step decode
    (``num_scheduler_steps`` k > 1) their k-step programs of the greedy and temperature-only
    samplers (``runner_multi.MULTI_STEP_WARM_VARIANTS``, what ``jaxinfer compile`` builds),
    and with async scheduling their token-gather programs. What the run needs
    beyond that (e.g. smaller waves when the KV pool admits fewer) is not guessed: the run
    reports the programs it compiles. Returns seconds and counts.
    """
    from jaxinfer.batch import Bucket, pick
    from jaxinfer.runner import GATHER, SAMPLE, gather_bucket
    from jaxinfer.runner_multi import MULTI_STEP_WARM_VARIANTS

    ec = engine.config
    t0, c0 = time.perf_counter(), CompileState.of(engine)
    M = ec.max_num_seqs
    waves = {max(1, min(num_seqs, M))}
    if num_seqs > M and num_seqs % M:
        waves.add(num_seqs % M)
    rng = np.random.default_rng(seed + WARMUP_SEED_OFFSET)
    lo = pick(ec.page_buckets, -(-(input_len + 1) // ec.block_size), "pages")
    hi = pick(ec.page_buckets, -(-(input_len + output_len) // ec.block_size), "pages")
    for n in sorted(waves, reverse=True):
        _say(f"warm-up: prefill of {n} prompts of {input_len} tokens")
        prompts = random_prompts(rng, [input_len] * n, engine.model_config.vocab_size)
        run_requests(engine, prompts, [fixed_length_params(1)] * n)
        if output_len > 1:  # the batch ramps up while prompts are prefilled: all buckets
            top = pick(ec.decode_buckets, n, "batch")
            for B in ec.decode_buckets:
                for P in ec.page_buckets:
                    bucket = Bucket("decode", B, B, P)
                    if not (B <= top and lo <= P <= hi):
                        continue
                    if (SAMPLE, bucket) not in engine.runner.compiled_buckets:
                        t = time.perf_counter()
                        engine.runner.executable(bucket)
                        _say(f"warm-up: decode program B={B} pages={P} "
                             f"({time.perf_counter() - t:.1f} s)")
                    if ec.num_scheduler_steps > 1:  # the k-step windows' programs too
                        for variant in MULTI_STEP_WARM_VARIANTS:
                            engine.multi_step_programs.executable(
                                bucket, variant, ec.num_scheduler_steps)
                # Async scheduling feeds a pipelined step's tokens through the gather
                # program of its batch bucket (the warm-up's own steps may not pipeline).
                gb = gather_bucket(B)
                if (ec.async_scheduling and B <= top
                        and (GATHER, gb) not in engine.runner.compiled_buckets):
                    engine.runner.executable(gb, GATHER)
    return {"warmup_s": time.perf_counter() - t0,
            **{f"warmup_{k}": v for k, v in CompileState.of(engine).since(c0).items()}}


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def run_requests(engine: Any, prompts: list[list[int]], params: list[SamplingParams], *,
                 time_limit: float | None = None, progress: Progress | None = None,
                 stats: dict[str, int] | None = None
                 ) -> tuple[list[RequestTimeline], float]:
    """Submit every prompt at once and step the engine until all finish or ``time_limit``
    seconds pass (then the unfinished ones are aborted and stay ``end=None``).

    Returns (one timeline per prompt, in order; seconds from the first submission to the
    last finish, or to the time limit). A request the engine finishes as "abort" gets
    ``error="abort"``. ``stats``, if given, receives ``peak_running`` (the most sequences
    one step ran: held running after it, or given output by it -- how much of
    ``max_num_seqs`` the KV pool let run) and ``preemptions`` (recompute preemptions during
    the run: the pool ran out).
    """
    sched = engine.scheduler
    preempted0, peak = sched.num_preemptions_total, 0
    t0 = time.perf_counter()
    timelines: dict[int, RequestTimeline] = {}
    order = []
    delta = with_output_kind(params, "delta")  # each step's output: only its new tokens
    for p, sp, sp_delta in zip(prompts, params, delta):
        start = time.perf_counter()
        rid = engine.add_request(p, sp_delta)
        timelines[rid] = RequestTimeline(start, len(p), sp.max_tokens)
        order.append(rid)
    pending = set(order)
    last = t0
    while pending:
        outs = engine.step()
        now = time.perf_counter()
        # running after the step, or (a step whose sequences all finished) those it served
        peak = max(peak, sched.num_running, len({o.request_id for o in outs}))
        for o in outs:
            tl = timelines.get(o.request_id)
            if tl is None or o.request_id not in pending:
                continue
            new = len(o.outputs[0].token_ids)
            if new > 0:
                tl.add(now, new)
            if o.finished:
                pending.discard(o.request_id)
                tl.end, last = now, now
                if o.outputs[0].finish_reason == "abort":
                    tl.error = "abort"
        if progress is not None:
            progress.tick(lambda e=now - t0: _status(timelines.values(), e))
        if time_limit is not None and now - t0 >= time_limit and pending:
            for rid in pending:
                engine.abort_request(rid)
            last = now
            break
    if progress is not None:
        progress.tick(lambda: _status(timelines.values(), last - t0), force=True)
    if stats is not None:
        stats.update(peak_running=peak,
                     preemptions=sched.num_preemptions_total - preempted0)
    return [timelines[r] for r in order], max(last - t0, 1e-9)


def _status(timelines: Any, elapsed: float) -> str:
    tls = list(timelines)
    done = sum(t.end is not None for t in tls)
    toks = sum(t.output_len for t in tls)
    return (f"{done}/{len(tls)} requests finished, {toks:,} output tokens, "
            f"{toks / max(elapsed, 1e-9):,.1f} tok/s")


def memory_report() -> dict[str, Any]:
    """Peak device memory (bytes, XLA's allocator; None on the CPU, which has no such
    counter), the process's peak resident host memory (bytes), the 1-minute load average."""
    import jax

    stats = jax.devices()[0].memory_stats() or {}
    return {"peak_device_memory_bytes": stats.get("peak_bytes_in_use"),
            "device_memory_limit_bytes": stats.get("bytes_limit"),
            "peak_host_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "loadavg_1min": os.getloadavg()[0]}  # the CPU may be shared with other jobs


def engine_config_record(engine: Any) -> dict[str, Any]:
    """The engine settings a result depends on (for the records' ``config``)."""
    import jax.numpy as jnp

    from jaxinfer.compile_cache import kernel_env

    ec, kv = engine.config, engine.kv_sizing
    return {"model": engine.model_name, "dtype": jnp.dtype(engine.dtype).name,
            "quantization": ec.quantization, "attention_backend": ec.attention_backend,
            "kv_cache_dtype": str(getattr(ec, "kv_cache_dtype", None) or "model dtype"),
            "scan_layers": bool(ec.scan_layers), "max_model_len": ec.max_model_len,
            "block_size": ec.block_size, "max_num_seqs": ec.max_num_seqs,
            "max_num_batched_tokens": ec.max_num_batched_tokens,
            "max_prefill_seqs": ec.max_prefill_seqs, "decode_buckets": list(ec.decode_buckets),
            "kv_pages": kv.num_pages - 1, "kv_tokens": kv.max_tokens,
            "kv_sizing": kv.source, "enable_prefix_caching": ec.enable_prefix_caching,
            "async_scheduling": bool(ec.async_scheduling),
            "num_scheduler_steps": ec.num_scheduler_steps,
            "matmul_backend": ec.matmul_backend, "kernel_env": kernel_env()}
