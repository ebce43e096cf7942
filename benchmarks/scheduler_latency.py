"""Scheduler benchmarks (CPU): stall of running streams while a long prompt arrives, TTFT with
prefix caching, KV waste and the 10,000-request allocator simulation.

    .venv/bin/python benchmarks/scheduler_latency.py [--model smollm2-135m|tiny]
        [--parts itl ttft waste sim]

itl   Three streams decode; a long prompt (--long tokens) arrives. Inter-token latency (ITL)
      of the running streams from its arrival to its first token, for: no chunking (the
      whole prompt in one prefill step), chunking with v1's prefill-first policy, and
      chunking with the alternation rule (max_consecutive_prefills = 1 and 2).
ttft  Requests that share a --system-token system prompt, each sent after the previous one
      finished; time to first token with and without prefix caching.
waste KV waste on a mixed-length workload (plain-Python scheduler, tests/core).
sim   10,000 random requests with shared prefixes through the scheduler and a fake model,
      pages checked after every step (tests/core): leaked / double-owned pages. With
      --sim-max-n N > 1 a third of the requests ask for 2..N samples (forks, page copies).

Every program is compiled in an untimed warm-up of the same scenario first, and the run
asserts no compilation happened while timed. Times are host wall-clock around
``LLMEngine.step()`` (tokens come back to the host every step). One JSON record per number
in benchmarks/results/.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import record

ROOT = Path(__file__).resolve().parents[1]


def _loaded(model: str):
    if model == "tiny":
        from tests.conftest import tiny_loaded

        return tiny_loaded("llama", max_position_embeddings=4096, vocab_size=1000)
    from jaxinfer.loading import load_model

    return load_model(model, progress=False)


def _engine(loaded, **kw):
    from jaxinfer.engine import LLMEngine

    args = {"max_model_len": 1536, "block_size": 16, "max_num_seqs": 4, "dtype": "float32"}
    args.update(kw)
    return LLMEngine(loaded, **args)


def itl_scenario(eng, rng: np.random.Generator, long_len: int, warm_steps: int = 4) -> dict:
    """3 decoding streams, then a long prompt; ITL of the streams until its first token."""
    from jaxinfer.sampling_params import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    streams = [eng.add_request(rng.integers(10, 1000, 24 + 8 * i).tolist(), sp)
               for i in range(3)]
    times: dict[int, list[float]] = {s: [] for s in streams}

    def step() -> list:
        outs = eng.step()
        now = time.perf_counter()
        for o in outs:
            if o.request_id in times:
                times[o.request_id].append(now)
        return outs

    while min(len(t) for t in times.values()) < warm_steps:
        step()
    before = [b - a for t in times.values() for a, b in zip(t[-warm_steps:], t[-warm_steps+1:])]
    t_arrive = time.perf_counter()
    long_id = eng.add_request(rng.integers(10, 1000, long_len).tolist(),
                              SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    n_before = {s: len(t) for s, t in times.items()}
    steps, ttft = 0, None
    while ttft is None:
        outs = step()
        steps += 1
        if any(o.request_id == long_id for o in outs):
            ttft = time.perf_counter() - t_arrive
    # Gaps of each stream from its last token before the arrival to its first token after
    # the long prompt's first token (that gap covers the prefill's effect).
    step()
    gaps = []
    for s, t in times.items():
        window = t[n_before[s] - 1:]
        gaps += [b - a for a, b in itertools.pairwise(window)]
    for rid in [*streams, long_id]:
        eng.abort_request(rid)
    return {"itl_max_ms": 1000 * max(gaps), "itl_mean_ms": 1000 * statistics.mean(gaps),
            "itl_p50_ms": 1000 * statistics.median(gaps),
            "itl_before_ms": 1000 * statistics.median(before), "long_ttft_s": ttft,
            "steps_to_first_token": steps}


def run_itl(loaded, long_len: int, chunk: int) -> list[dict]:
    chunked = {"max_num_batched_tokens": chunk}
    variants = [("no chunking", {"max_num_batched_tokens": long_len + 64,
                                 "max_consecutive_prefills": None}),
                ("chunked, prefill first (v1)", {**chunked, "max_consecutive_prefills": None}),
                ("chunked, alternate k=1", {**chunked, "max_consecutive_prefills": 1}),
                ("chunked, alternate k=2", {**chunked, "max_consecutive_prefills": 2})]
    rows = []
    for name, kw in variants:
        eng = _engine(loaded, enable_prefix_caching=False, **kw)
        itl_scenario(eng, np.random.default_rng(1), long_len)  # warm-up: compiles
        n = eng.runner.num_compilations + eng.runner.num_loaded
        res = itl_scenario(eng, np.random.default_rng(2), long_len)
        assert eng.runner.num_compilations + eng.runner.num_loaded == n, "compiled while timed"
        rows.append({"variant": name, **kw, **res})
        print(f"  {name:30s} ITL max {res['itl_max_ms']:8.1f} ms  mean {res['itl_mean_ms']:7.1f}"
              f"  p50 {res['itl_p50_ms']:6.1f}  (steady {res['itl_before_ms']:5.1f})  long TTFT "
              f"{res['long_ttft_s']:6.2f} s in {res['steps_to_first_token']} steps", flush=True)
    return rows


def ttft_scenario(eng, system: list[int], rng: np.random.Generator, n: int) -> list[float]:
    from jaxinfer.sampling_params import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        rid = eng.add_request(system + rng.integers(10, 1000, 24).tolist(), sp)
        first = None
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.request_id == rid and first is None and o.outputs[0].token_ids:
                    first = time.perf_counter() - t0
        out.append(first)
    return out


def run_ttft(loaded, system_len: int, n: int) -> list[dict]:
    rows = []
    system = np.random.default_rng(0).integers(10, 1000, system_len).tolist()
    for caching in (False, True):
        eng = _engine(loaded, enable_prefix_caching=caching, max_num_batched_tokens=512)
        ttft_scenario(eng, system, np.random.default_rng(1), 2)  # warm-up: compiles
        eng.scheduler.block_manager.reset_prefix_cache()
        n0 = eng.runner.num_compilations + eng.runner.num_loaded
        bm = eng.scheduler.block_manager
        hits0 = bm.prefix_hit_tokens
        t = ttft_scenario(eng, system, np.random.default_rng(2), n)
        assert eng.runner.num_compilations + eng.runner.num_loaded == n0, "compiled while timed"
        row = {"prefix_caching": caching, "first_ttft_s": t[0],
               "later_ttft_median_s": statistics.median(t[1:]), "all_ttft_s": t,
               "hit_tokens": bm.prefix_hit_tokens - hits0}
        rows.append(row)
        print(f"  prefix caching {caching!s:5s}: first request {t[0]:6.3f} s, later "
              f"requests median {row['later_ttft_median_s']:6.3f} s, cached tokens "
              f"{row['hit_tokens']}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m", help="named model, path or 'tiny'")
    ap.add_argument("--parts", nargs="+", default=["itl", "ttft", "waste", "sim"])
    ap.add_argument("--long", type=int, default=1024, help="long prompt tokens (itl)")
    ap.add_argument("--chunk", type=int, default=128, help="prefill chunk budget (itl)")
    ap.add_argument("--system-tokens", type=int, default=512)
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--sim-max-n", type=int, default=1, help="most samples per request (sim)")
    ns = ap.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    jax.config.update("jax_compilation_cache_dir", str(ROOT / ".cache" / "jax-bench-cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    base = {"model": ns.model, "dtype": "float32", "block_size": 16, "max_num_seqs": 4}
    if "itl" in ns.parts or "ttft" in ns.parts:
        loaded = _loaded(ns.model)
    if "itl" in ns.parts:
        print(f"ITL of 3 running streams while a {ns.long}-token prompt arrives "
              f"(chunk budget {ns.chunk}):")
        for r in run_itl(loaded, ns.long, ns.chunk):
            cfg = {**base, "long_prompt": ns.long, "variant": r["variant"],
                   "max_num_batched_tokens": r["max_num_batched_tokens"],
                   "max_consecutive_prefills": r["max_consecutive_prefills"],
                   "itl_mean_ms": r["itl_mean_ms"], "itl_p50_ms": r["itl_p50_ms"],
                   "itl_steady_ms": r["itl_before_ms"], "long_ttft_s": r["long_ttft_s"]}
            record("sched_itl_max_during_long_prefill", r["itl_max_ms"], "ms", cfg)
    if "ttft" in ns.parts:
        print(f"TTFT, {ns.requests} sequential requests sharing a {ns.system_tokens}-token "
              f"system prompt (+24 own tokens):")
        for r in run_ttft(loaded, ns.system_tokens, ns.requests):
            cfg = {**base, "system_tokens": ns.system_tokens, "suffix_tokens": 24,
                   "requests": ns.requests, "prefix_caching": r["prefix_caching"],
                   "first_ttft_s": r["first_ttft_s"], "all_ttft_s": r["all_ttft_s"],
                   "cached_tokens": r["hit_tokens"], "max_num_batched_tokens": 512}
            record("sched_ttft_shared_system_prompt", r["later_ttft_median_s"], "s", cfg)
    if "waste" in ns.parts:
        from tests.core.test_scheduler import kv_waste_run

        print("KV waste, mixed lengths (300 requests, log-normal prompts, outputs 1..300):")
        for ps in (8, 16, 32):
            sim = kv_waste_run(ps)
            print(f"  page_size {ps:3d}: {100 * sim.stats.kv_waste:5.2f} %")
            record("sched_kv_waste_mixed_lengths", 100 * sim.stats.kv_waste, "%",
                   {"page_size": ps, "requests": 300, "workload": "tests/core kv_waste_run"})
    if "sim" in ns.parts:
        from jaxinfer.scheduler import SchedulerConfig
        from tests.core.test_scheduler import EOS, run_random

        cfg = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=64, max_model_len=160,
                              page_size=8, num_pages=60, max_prefill_seqs=4, max_queue_len=40,
                              eos_token_ids=(EOS,))
        t0 = time.perf_counter()
        n = ns.sim_max_n
        sim = run_random(cfg, 10_000, seed=10_000 * n, max_prompt=80, max_out=60,
                         abort_rate=0.005, max_n=n)  # raises on any leaked / double-owned page
        bm = sim.sched.block_manager
        leaked = bm.num_usable_pages - bm.num_free_pages  # all finished: every page free
        print(f"10,000 requests: {sim.stats.steps} steps, every step checked; leaked pages "
              f"{leaked}, prefix hit rate {100 * bm.prefix_hit_rate:.1f} %, "
              f"{sim.stats.preemptions} preemptions, {bm.num_evictions} evictions, "
              f"{sim.forks} forked samples, {sim.copies} page copies "
              f"({time.perf_counter() - t0:.0f} s)")
        record("sched_sim_10k_leaked_pages", leaked, "pages",
               {"requests": 10_000, "steps": sim.stats.steps, "prefix_caching": True,
                "prefix_hit_rate": bm.prefix_hit_rate, "preemptions": sim.stats.preemptions,
                "evictions": bm.num_evictions, "aborted": len(sim.aborted),
                "max_samples_per_request": n, "forked_samples": sim.forks,
                "page_copies": sim.copies,
                "checks": "tests/core/test_scheduler.py check_pages + KV read-back, every step"})


if __name__ == "__main__":
    main()
