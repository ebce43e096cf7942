"""Worker processes of ``jaxinfer compile`` and its phase log (split from jaxinfer/compile.py).

:class:`CompilePool` spawns processes that import JAX while the parent reads the
configuration, build their abstract runner (:func:`jaxinfer.compile.abstract_runner`) and
fingerprint once, and compile programs to serialized executables; :class:`PhaseLog` logs the
command's phases in seconds since the process started (``-v``).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jaxinfer.config import EngineConfig, ModelConfig

if TYPE_CHECKING:
    from jaxinfer.compile_cache import Program

log = logging.getLogger("jaxinfer.compile")


# ----------------------------------------------------------------------------- phase log
def process_start_time() -> float:
    """When this process started, as ``time.time()`` (Linux /proc; elsewhere: now)."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return time.time() - uptime + int(fields[19]) / os.sysconf("SC_CLK_TCK")  # starttime
    except (OSError, ValueError, IndexError):
        return time.time()


class PhaseLog:
    """Seconds from process start to each phase of ``jaxinfer compile``, logged at INFO
    (``-v``) as ``phase NAME: 12.34 s``; ``marks`` keeps them in order."""

    def __init__(self) -> None:
        self.t0 = process_start_time()
        self.marks: dict[str, float] = {}

    def mark(self, name: str, at: float | None = None) -> None:
        """Record phase ``name`` as reached now (or at the ``time.time()`` value ``at``)."""
        self.marks[name] = (time.time() if at is None else at) - self.t0
        log.info("phase %s: %.2f s", name, self.marks[name])


# ----------------------------------------------------------------------------- bucket set

def _compile_program(runner: Any, program: Program) -> tuple[bytes, float]:
    """(serialized program, seconds to trace, lower and compile it) for one program.

    Raises CompileCacheError if the program came from JAX's persistent compilation cache: with
    jaxlib 0.11.2 an XLA:CPU executable loaded from there re-serializes without some of its
    kernels ("Function wrapped_iota not found" when run), so it must not be stored.
    """
    import jax

    from jaxinfer.compile_cache import CompileCacheError, serialize_program, xla_compilations

    # From scratch: a program this process already built (the runner's shared sampler and
    # helper programs, see runner._SHARED) would come from jit's in-memory cache, compiled by
    # nobody here and refused below.
    jax.clear_caches()
    before, t0 = xla_compilations(), time.perf_counter()
    from jaxinfer.compile import lower_program
    from jaxinfer.runner import COMPILER_OPTIONS

    compiled = lower_program(runner, program).compile(compiler_options=COMPILER_OPTIONS)
    seconds = time.perf_counter() - t0
    if xla_compilations() == before:
        raise CompileCacheError(f"{program.mode} {program.bucket} came from JAX's persistent "
                                "compilation cache and cannot be re-serialized; compile with "
                                "that cache off")
    blob = serialize_program(compiled)
    del compiled
    # JAX's in-memory caches keep every executable alive: 35 MB per unrolled SmolLM2 program
    # on CPU (4.7 GB for the default set) against 3 MB when cleared after each one.
    jax.clear_caches()
    return blob, seconds


# Set in each worker process: its abstract runner, fingerprint and phase times.
_worker: dict[str, Any] = {}


def _worker_start(arrived: Any, configs: Any) -> None:
    """Pool initializer: the imports and backend start-up, before any configuration is known
    (so workers start with the command, while the parent reads the model's configuration);
    ``arrived`` and ``configs`` are the pool's queues :func:`_worker_hold` uses."""
    import jax

    import jaxinfer.compile_cache
    import jaxinfer.runner  # noqa: F401 - the heavy imports, done while the parent sets up

    jax.config.update("jax_enable_compilation_cache", False)  # see _compile_program
    jax.devices()
    _worker.update(arrived=arrived, configs=configs, times={"imported": time.time()})


def _worker_hold() -> tuple[int, dict, dict]:
    """Say this worker is ready, then wait for the configuration and set up for it (see
    :func:`_worker_setup`). Held, a worker takes no other task: a pool spawns a worker per
    task submitted while none is idle, and the parent hands out the configurations only once
    every held task has arrived, so each worker gets one."""
    _worker["arrived"].put(os.getpid())
    return _worker_setup(*_worker["configs"].get(timeout=3600))


def _worker_setup(model_config: ModelConfig, ec: EngineConfig) -> tuple[int, dict, dict]:
    """Build this worker's abstract runner and fingerprint for (model_config, ec) once;
    returns (pid, phase times, fingerprint)."""
    from jaxinfer.compile import abstract_runner
    from jaxinfer.compile_cache import fingerprint

    if _worker.get("config") != (model_config, ec):
        runner = abstract_runner(model_config, ec)
        _worker.update(config=(model_config, ec), runner=runner,
                       fp=fingerprint(model_config, ec, runner))
        _worker.setdefault("times", {})["ready"] = time.time()
    return os.getpid(), _worker["times"], _worker["fp"]


def _worker_compile(model_config: ModelConfig, ec: EngineConfig, fp: dict,
                    program: Program) -> tuple[bytes, float]:
    """Compile ``program`` in this worker. Raises CompileCacheError if the worker's
    fingerprint differs from ``fp`` (the one the manifest records)."""
    from jaxinfer.compile_cache import CompileCacheError, diff_fingerprints

    _worker_setup(model_config, ec)
    diffs = diff_fingerprints(fp, _worker["fp"])
    if diffs:
        raise CompileCacheError(f"compile worker {os.getpid()} differs from the cache: {diffs}")
    return _compile_program(_worker["runner"], program)


class CompilePool:
    """Spawned worker processes that compile programs (tracing and lowering are Python-bound,
    so threads would not help). Workers start importing JAX and jaxinfer when the pool is
    made (``start`` of them, default ``jobs``; :meth:`setup` starts the rest it needs) and
    :meth:`setup` gives them the configuration. Workers are spawned ("fork" is unsafe
    with JAX's threads); ``JAXINFER_COMPILE_START=forkserver`` forks them instead from a server
    that imported JAX once (one import instead of one per worker; an experiment: see
    benchmarks/RESULTS.md, "Start-up (CPU)")."""

    def __init__(self, jobs: int, phases: PhaseLog | None = None, start: int | None = None):
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        # Workers only compile: keep them from reserving accelerator memory.
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
        self.jobs = jobs
        self.phases = phases or PhaseLog()
        if os.environ.get("JAXINFER_COMPILE_START", "spawn") == "forkserver":
            ctx = multiprocessing.get_context("forkserver")
            ctx.set_forkserver_preload(["jax", "jaxinfer.runner", "jaxinfer.compile_cache"])
        else:
            ctx = multiprocessing.get_context("spawn")
        self._arrived, self._configs = ctx.Queue(), ctx.Queue()
        self.pool = ProcessPoolExecutor(jobs, ctx, initializer=_worker_start,
                                        initargs=(self._arrived, self._configs))
        self.config: tuple[ModelConfig, EngineConfig] | None = None
        self.fp: dict | None = None
        self.closed = False
        self._held: list[Any] = []
        self.grow(jobs if start is None else start)

    def grow(self, n: int) -> None:
        """Start workers until ``n`` of them (at most ``jobs``) run, all at once: the pool
        spawns one per task submitted while none is idle, and held tasks keep them busy."""
        n = min(n, self.jobs)
        if self.config is not None or len(self._held) >= n:
            return
        while len(self._held) < n:
            self._held.append(self.pool.submit(_worker_hold))
        self.phases.mark(f"workers started: {n}")

    def setup(self, model_config: ModelConfig, ec: EngineConfig, n: int) -> dict:
        """Start workers up to ``n`` (at most ``jobs``), wait until every worker has imported,
        have each build its abstract runner for (model_config, ec), and return their
        fingerprint: no worker compiles while another still imports. Raises
        CompileCacheError if two workers' fingerprints differ."""
        import queue

        from jaxinfer.compile_cache import CompileCacheError, diff_fingerprints

        self.grow(max(1, n))
        # No more workers from here on: the pool would spawn one per task submitted while
        # its workers finish their held tasks (ProcessPoolExecutor keeps the limit there).
        self.pool._max_workers = len(self._held)  # type: ignore[attr-defined]
        self.config = (model_config, ec)
        arrived = 0
        while arrived < len(self._held):
            try:
                self._arrived.get(timeout=1.0)
                arrived += 1
            except queue.Empty:
                for f in self._held:  # a held task ends early only if its worker failed
                    if f.done():
                        f.result()
        for _ in self._held:
            self._configs.put(self.config)
        results = [f.result() for f in self._held]
        for _, _, fp in results[1:]:
            diffs = diff_fingerprints(results[0][2], fp)
            if diffs:
                raise CompileCacheError(f"compile workers differ: {diffs}")
        times = {pid: t for pid, t, _ in results}.values()
        for key in ("imported", "ready"):
            stamps = [t[key] for t in times if key in t]
            self.phases.mark(f"first worker {key}", min(stamps))
            self.phases.mark(f"last worker {key}", max(stamps))
        self.fp = results[0][2]
        return self.fp

    def compile(self, programs: list[Program]) -> Iterator[tuple[Program, tuple[bytes, float]]]:
        """(program, (serialized program, compile seconds)) as each finishes."""
        from concurrent.futures import as_completed

        assert self.config is not None and self.fp is not None, "setup() first"
        futures = {self.pool.submit(_worker_compile, *self.config, self.fp, p): p
                   for p in programs}
        self.phases.mark("compiles submitted")
        for f in as_completed(futures):
            yield futures[f], f.result()

    def close(self) -> None:
        """Stop the workers now: they hold nothing the parent needs once its results are in
        (a graceful shutdown waits for each to tear JAX down)."""
        if self.closed:
            return
        self.closed = True
        procs = list(getattr(self.pool, "_processes", {}).values())
        self.pool.shutdown(wait=False, cancel_futures=True)
        for p in procs:
            p.kill()
        for p in procs:
            p.join()
        self.phases.mark("workers stopped")


def default_jobs() -> int:
    """Worker processes for compiling: half the cores, 1 to 8."""
    return max(1, min(8, (os.cpu_count() or 2) // 2))
