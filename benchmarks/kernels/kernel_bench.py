"""Pieces the kernel benchmarks share: timing of queued runs, relative error, and a record
list rewritten to ``<out>/<file>`` after every value (a run cut off by its deadline keeps
what it measured). Records are ``jaxinfer.bench.records.make_record`` dicts."""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from typing import Any

import jax
import numpy as np

from jaxinfer.bench.records import make_record


def time_fn(run, args_list, repeats: int, min_s: float = 0.1, max_runs: int = 200) -> float:
    """Seconds per run: queue runs back to back (cycling through ``args_list``), block once,
    median over ``repeats``; each repeat holds ~``min_s`` seconds, 3..``max_runs`` runs."""
    jax.block_until_ready(run(*args_list[0]))
    t = time.perf_counter()
    jax.block_until_ready(run(*args_list[1 % len(args_list)]))
    n = int(min(max_runs, max(3, min_s / max(time.perf_counter() - t, 1e-6))))
    res = []
    for _ in range(repeats):
        t = time.perf_counter()
        for i in range(n):
            out = run(*args_list[i % len(args_list)])
        jax.block_until_ready(out)
        res.append((time.perf_counter() - t) / n)
    return float(np.median(res))


def rel_err(o, r) -> float:
    """Relative L2 error of ``o`` against ``r`` in float64; inf if ``o`` has a non-finite."""
    o, r = np.asarray(o, np.float64), np.asarray(r, np.float64)
    if not np.all(np.isfinite(o)):
        return float("inf")
    return float(np.linalg.norm(o - r) / max(np.linalg.norm(r), 1e-30))


class RunRecords(list):
    """The records of one benchmark run, rewritten as one JSON list to ``out_dir/file_name``
    (if ``out_dir``) after each :meth:`add`; ``common_config`` (e.g. the run's --patch
    values) joins every record's config."""

    def __init__(self, script: str, out_dir: str | None = None,
                 file_name: str = "results.json"):
        super().__init__()
        self.command = f"PYTHONPATH=. python3 {script} " + " ".join(sys.argv[1:])
        self.out_dir, self.file_name = out_dir, file_name
        self.common_config: dict[str, Any] = {}

    def add(self, name: str, value: Any, unit: str, config: dict[str, Any]) -> None:
        config = {**config, **self.common_config}
        self.append(make_record(name, value, unit, config, self.command))
        self.dump()

    def dump(self) -> None:
        if self.out_dir:
            with open(os.path.join(self.out_dir, self.file_name), "w") as f:
                json.dump(list(self), f, indent=1)


class Cupti:
    """Summed kernel time (µs) and kernel count per call of a chained run, via CUPTI."""

    def __init__(self, enabled: bool):
        self.enabled = enabled

    def __call__(self, run, args, calls: int, carry: int = 0) -> tuple[float, float, str]:
        """(µs of kernels a call / ``calls``, kernels a call / ``calls``, kernel names) of
        ``run(*args)``, the median of 3 runs after a warm-up. ``carry`` > 0: ``run`` donates
        its first ``carry`` arguments and returns their successors first (a KV cache written
        in place), so each run takes the previous run's outputs: ``args`` must be a list, and
        holds the last outputs on return (or the last valid ones if CUPTI failed)."""
        if not self.enabled:
            return float("nan"), float("nan"), ""
        try:
            from jax.experimental.mosaic.gpu import profiler
            if carry:
                ts = _measure_carried(run, args, carry, 3)
            else:
                _, ts = profiler.measure(run, aggregate=False, iterations=3)(*args)
        except Exception as e:  # noqa: BLE001  CUPTI missing: wall clock only
            print("CUPTI failed, wall clock only:", repr(e)[:200], file=sys.stderr, flush=True)
            self.enabled = False
            return float("nan"), float("nan"), ""
        if not ts:
            return float("nan"), float("nan"), ""
        per_run = statistics.median(sum(ms for _, ms in it) for it in ts) * 1e3
        names = sorted({n.split("(")[0][:40] for n, _ in ts[0]})
        return per_run / calls, len(ts[0]) / calls, ",".join(names)


def _measure_carried(run, args: list, carry: int, iterations: int) -> list | None:
    """profiler.measure(aggregate=False)'s per-iteration kernel timings for a ``run`` that
    donates its first ``carry`` arguments: each call takes the last call's outputs (JAX's
    measure calls ``run`` with the same arguments every time, which donation forbids).
    Uses the same CUPTI hooks as jax.experimental.mosaic.gpu.profiler (jax 0.11.2)."""
    from jax._src.lib import mosaic_gpu as mosaic_gpu_lib

    def call():
        out = run(*args)
        args[:carry] = out[:carry]
        return out

    jax.block_until_ready(call())  # warm-up
    ext = mosaic_gpu_lib._mosaic_gpu_ext
    ext._cupti_init()
    try:
        for _ in range(iterations):
            jax.block_until_ready(call())
    finally:
        timings = ext._cupti_get_timings(True)
    if not timings:
        return None
    if len(timings) % iterations:
        raise RuntimeError("kernel launches not divisible by the iterations")
    n = len(timings) // iterations
    return [timings[i * n:(i + 1) * n] for i in range(iterations)]
