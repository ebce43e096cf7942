"""``jaxinfer bench offline``: N requests of fixed input/output lengths submitted at once
(EOS ignored), as TensorRT-LLM's and vLLM's throughput benchmarks run them.

Phases, each timed on its own: engine start (weights, KV sizing), loading a compile cache
(``--compile-cache-dir``), warm-up (compiles the programs the workload needs; see
``driver.warm_up``), the measured run. Reported: output and total tok/s, request/s, TTFT /
TPOT / ITL / end-to-end percentiles, the most sequences running at once and the recompute
preemptions (a KV pool too small for ``--max-num-seqs`` shows in both), programs compiled
inside the measured run (and their seconds), peak device memory, the KV pool (pages,
tokens). ``--time-limit`` aborts what has not finished when it expires and reports what
did; progress prints every ``--progress-interval`` seconds.

Several workloads may share one engine start: ``--input-len 128,1000 --output-len 128,1000
--num-prompts 1024,512`` runs 128/128 then 1000/1000 on the same engine (one record file and
one summary table each; a single value applies to every workload). Each workload has its own
warm-up, so its measured run is what running it alone would measure, less the engine start.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import numpy as np

from jaxinfer.bench import driver
from jaxinfer.bench.cli import non_negative_float
from jaxinfer.bench.metrics import Progress, format_table, summarize, unit_of
from jaxinfer.bench.records import check_out_dir, make_record, write_run


def add_parser(sub: Any, add_common: Any) -> None:
    """Register ``bench offline``; ``add_common`` adds the engine and output options."""
    p = sub.add_parser("offline", help="throughput: N fixed-length requests submitted at once",
                       description=__doc__.splitlines()[0])
    add_common(p)
    p.add_argument("--input-len", type=_counts, default=(128,),
                   help="prompt tokens (ISL); a comma list runs one workload per entry")
    p.add_argument("--output-len", type=_counts, default=(128,),
                   help="new tokens (OSL), EOS ignored; one value or one per workload")
    p.add_argument("--num-prompts", type=_counts, default=(64,),
                   help="requests submitted at once; one value or one per workload")
    driver.add_sampling_args(p)
    p.add_argument("--time-limit", type=non_negative_float, default=None,
                   help="seconds after which the measured run aborts what has not finished "
                        "and reports what has")
    p.add_argument("--no-warmup", action="store_true",
                   help="compile inside the measured run (reported) instead of before it")
    p.set_defaults(func=cmd_offline)


def _counts(text: str) -> tuple[int, ...]:
    """A comma list of integers (``cli._ints``; checked >= 1 by :func:`check_lengths`)."""
    from jaxinfer.cli_options import _ints

    return _ints(text)


def workloads(ns: argparse.Namespace) -> list[tuple[int, int, int]]:
    """``(input_len, output_len, num_prompts)`` per workload from the (list) options; a
    single value applies to every workload. Raises ValueError for lists of different
    lengths, a value below 1 or more requests than host memory holds."""
    lists = {"--input-len": ns.input_len, "--output-len": ns.output_len,
             "--num-prompts": ns.num_prompts}
    lists = {k: (v,) if isinstance(v, int) else tuple(v) for k, v in lists.items()}
    n = max(len(v) for v in lists.values())
    for k, v in lists.items():
        if len(v) not in (1, n):
            raise ValueError(f"{k} has {len(v)} values; give 1 or {n} (one per workload)")
    out = [tuple(v[i] if len(v) > 1 else v[0] for v in lists.values()) for i in range(n)]
    for isl, osl, num in out:
        check_lengths(isl, osl, num)
        driver.check_host_room(num, isl + osl)
    return out


def check_lengths(input_len: int, output_len: int, num: int) -> None:
    """Raise ValueError (a one-line CLI error) for lengths or counts below 1."""
    for name, v in (("--input-len", input_len), ("--output-len", output_len),
                    ("--num-prompts", num)):
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")


def run_offline(ns: argparse.Namespace) -> list[dict[str, Any]]:
    """Run the benchmark's workloads for parsed CLI options on one engine; returns one
    ``{"summary", "config", "path"}`` per workload.

    Raises ValueError (bad lengths, ConfigError, RequestError, a sampling option out of its
    range: ParameterError) before any request runs.
    """
    work = workloads(ns)
    driver.params_of(ns, 1)  # a bad --top-p etc. fails before the engine starts
    check_out_dir(ns.out)
    if ns.max_num_seqs is None:
        ns.max_num_seqs = min(max(n for _, _, n in work), 256)
    need = max(i + o for i, o, _ in work)
    if ns.max_model_len is None:
        ns.max_model_len = driver.page_round(need, ns.block_size)
    elif need > ns.max_model_len:  # the warm-up would fail on a page bucket, unexplained
        raise ValueError(f"input-len + output-len = {need} tokens exceeds --max-model-len "
                         f"({ns.max_model_len})")
    engine, phases = driver.build_engine(ns)
    return [_run_workload(engine, dict(phases), ns, *w) for w in work]


def _run_workload(engine: Any, phases: dict[str, Any], ns: argparse.Namespace, isl: int,
                  osl: int, n: int) -> dict[str, Any]:
    """Warm up, run and record one workload on a started engine."""
    print(f"jaxinfer bench offline: {engine.model_name}, {n} x ISL {isl} / OSL {osl}; "
          f"{engine.kv_sizing.describe(engine.config.max_model_len)}", file=sys.stderr,
          flush=True)
    if not ns.no_warmup:
        phases.update(driver.warm_up(engine, isl, osl, n, ns.seed))
        print(f"warm-up: {phases['warmup_s']:.1f} s, {phases['warmup_programs_compiled']} "
              f"programs compiled ({phases['warmup_compile_s']:.1f} s)", file=sys.stderr,
              flush=True)
    rng = np.random.default_rng(ns.seed)
    prompts = driver.random_prompts(rng, [isl] * n, engine.model_config.vocab_size)
    params = [driver.params_of(ns, osl)] * n
    before = driver.CompileState.of(engine)
    stats: dict[str, int] = {}
    timelines, duration = driver.run_requests(
        engine, prompts, params, time_limit=ns.time_limit,
        progress=Progress("offline", ns.progress_interval), stats=stats)
    s = summarize(timelines, duration)
    s.update(stats)
    s.update({f"run_{k}": v for k, v in driver.CompileState.of(engine).since(before).items()})
    s.update(phases)
    s.update(driver.memory_report())
    s["kv_pages"] = engine.kv_sizing.num_pages - 1
    s["kv_tokens"] = engine.kv_sizing.max_tokens
    config = {**driver.engine_config_record(engine), "input_len": isl, "output_len": osl,
              "num_prompts": n, **driver.sampling_config(ns), "time_limit_s": ns.time_limit,
              "warmup": not ns.no_warmup, "compile_cache_dir": ns.cache_dir, "seed": ns.seed}
    records = [make_record(f"bench_offline.{k}", v, unit_of(k), config)
               for k, v in s.items()]
    path = write_run(f"bench_offline-{engine.model_name}-{isl}x{osl}", records, ns.out)
    print(f"records: {path}", file=sys.stderr, flush=True)
    print(format_table(summary_rows(s), f"bench offline: {engine.model_name} "
                                        f"ISL {isl} / OSL {osl}, {n} requests"), flush=True)
    return {"summary": s, "config": config, "path": path}


def summary_rows(s: dict[str, Any]) -> list[tuple[str, Any]]:
    """The rows of the printed summary table."""
    def gib(b: Any) -> Any:
        return None if b is None else round(b / 2**30, 2)

    return [
        ("requests completed / submitted", f"{s['completed']} / {s['num_requests']}"),
        ("errors, unfinished, length mismatches",
         f"{s['errors']}, {s['unfinished']}, {s['length_mismatches']}"),
        ("measured duration (s)", s["duration_s"]),
        ("output tok/s", s["output_throughput"]),
        ("total tok/s (prompt + output)", s["total_token_throughput"]),
        ("requests/s", s["request_throughput"]),
        ("TTFT p50 / p99 (ms)", f"{s['ttft_ms_p50']:.4g} / {s['ttft_ms_p99']:.4g}"),
        ("TPOT p50 / p99 (ms)", f"{s['tpot_ms_p50']:.4g} / {s['tpot_ms_p99']:.4g}"),
        ("ITL p50 / p99 (ms)", f"{s['itl_ms_p50']:.4g} / {s['itl_ms_p99']:.4g}"),
        ("running sequences peak, preemptions",
         f"{s['peak_running']}, {s['preemptions']}"),
        ("engine start (s)", s["load_s"]),
        ("  weights read / to device / KV pool (s)",
         " / ".join(f"{s.get(k, float('nan')):.3g}" for k in
                    ("start_read_weights_s", "start_weights_to_device_s", "start_kv_pool_s"))),
        ("compile cache load (s, programs)",
         f"{s['preload_s']:.3g}, {s['programs_preloaded']}"),
        ("warm-up (s, programs compiled, compile s)",
         f"{s.get('warmup_s', 0):.3g}, {s.get('warmup_programs_compiled', 0)}, "
         f"{s.get('warmup_compile_s', 0):.3g}" if "warmup_s" in s else "skipped"),
        ("compiled in measured run (programs, s)",
         f"{s['run_programs_compiled']}, {s['run_compile_s']:.3g}"),
        ("KV pool (pages, tokens)", f"{s['kv_pages']:,}, {s['kv_tokens']:,}"),
        ("peak device memory (GiB)", gib(s["peak_device_memory_bytes"])),
        ("peak host RSS (GiB)", gib(s["peak_host_rss_bytes"])),
    ]


def cmd_offline(ns: argparse.Namespace) -> int:
    ok = [r["summary"]["errors"] == 0 and r["summary"]["length_mismatches"] == 0
          for r in run_offline(ns)]
    return 0 if all(ok) else 1
