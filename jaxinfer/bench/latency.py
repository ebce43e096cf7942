"""``jaxinfer bench latency``: the latency table.

1. TTFT of single prompts of each ``--prompt-lens`` length (one request at a time, one new
   token; median of ``--repeats`` after an untimed run of the same length).
2. Concurrency sweep: for each ``--concurrency`` c, c requests of ``--input-len`` /
   ``--output-len`` tokens submitted at once (after a warm-up of the same shape): output
   tok/s, TPOT and ITL percentiles. c = 1 is the batch-1 TPOT.
3. Roofline of each sweep point: the decode step (ITL p50) against the bytes and FLOPs one
   step of c sequences at the mean decode context needs (``roofline.py``), as fractions of
   the copy bandwidth and matmul rate measured in the same process (``--ceilings``).
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any

import numpy as np

from jaxinfer.bench import driver, roofline
from jaxinfer.bench.metrics import Progress, format_table, summarize, unit_of
from jaxinfer.bench.records import check_out_dir, make_record, write_run


def _ints(text: str) -> tuple[int, ...]:
    from jaxinfer.cli_options import _ints as parse

    vals = parse(text)
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return vals


def add_parser(sub: Any, add_common: Any) -> None:
    """Register ``bench latency``; ``add_common`` adds the engine and output options."""
    p = sub.add_parser("latency", help="TTFT per prompt length, TPOT and tok/s per "
                                       "concurrency, roofline", description=__doc__.splitlines()[0])
    add_common(p)
    p.add_argument("--prompt-lens", type=_ints, default=(128, 1024, 4096),
                   help="TTFT prompt lengths (default: 128,1024,4096)")
    p.add_argument("--repeats", type=int, default=3, help="timed TTFT runs per length")
    p.add_argument("--concurrency", type=_ints, default=(1, 16, 64, 128),
                   help="streams decoding together (default: 1,16,64,128)")
    p.add_argument("--input-len", type=int, default=128, help="sweep prompt tokens")
    p.add_argument("--output-len", type=int, default=128, help="sweep new tokens (EOS ignored)")
    driver.add_sampling_args(p)
    p.add_argument("--ceilings", default="measure",
                   help="'measure' (copy bandwidth and matmul rate in the engine's dtype, in "
                        "this process, before the engine starts), "
                        "'none', or 'GBPS,TFLOPS' given by hand")
    p.set_defaults(func=cmd_latency)


def parse_ceilings(text: str, dtype: str = "auto") -> dict[str, Any] | None:
    """``--ceilings``: None for 'none', measured for 'measure' (matmul in the engine's
    ``dtype``), else 'GB/s,TFLOP/s'."""
    from jaxinfer.engine_config import _resolve_dtype

    if text == "none":
        return None
    if text == "measure":
        return {**roofline.measure_ceilings(_resolve_dtype(dtype)),
                "ceilings_source": "measured"}
    try:
        gbps, tflops = (float(v) for v in text.split(","))
    except ValueError:
        raise ValueError(f"--ceilings must be 'measure', 'none' or 'GBPS,TFLOPS', got {text!r}")
    if not all(math.isfinite(v) and v > 0 for v in (gbps, tflops)):
        raise ValueError(f"--ceilings: GB/s and TFLOP/s must be finite and > 0, got {text!r}")
    return {"copy_bytes_per_s": gbps * 1e9, "matmul_flops_per_s": tflops * 1e12,
            "ceilings_source": "given"}


def run_latency(ns: argparse.Namespace) -> dict[str, Any]:
    """Run the three parts for parsed CLI options; returns ``{"ttft", "sweep", "ceilings",
    "path"}`` (ttft: {length: ms stats}; sweep: {c: summary + roofline})."""
    isl, osl = ns.input_len, ns.output_len
    for name, v in (("--input-len", isl), ("--output-len", osl), ("--repeats", ns.repeats)):
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    driver.params_of(ns, 1)  # a bad --top-p etc. fails before the engine starts
    check_out_dir(ns.out)
    if ns.max_num_seqs is None:
        ns.max_num_seqs = max(ns.concurrency)
    elif max(ns.concurrency) > ns.max_num_seqs:  # it would be recorded as c streams
        raise ValueError(f"--concurrency {max(ns.concurrency)} > --max-num-seqs "
                         f"{ns.max_num_seqs}: at most {ns.max_num_seqs} streams would run "
                         f"at once")
    need = max(max(ns.prompt_lens) + 1, isl + osl)
    if ns.max_model_len is None:
        ns.max_model_len = driver.page_round(need, ns.block_size)
    elif need > ns.max_model_len:
        raise ValueError(f"the longest request needs {need} tokens; --max-model-len is "
                         f"{ns.max_model_len}")
    if ns.max_num_batched_tokens is None:  # a TTFT prompt is one prefill step
        ns.max_num_batched_tokens = max(512, max(ns.prompt_lens))
    ceilings = parse_ceilings(ns.ceilings, ns.dtype)
    engine, phases = driver.build_engine(ns)
    cfg = engine.model_config
    print(f"jaxinfer bench latency: {engine.model_name}; "
          f"{engine.kv_sizing.describe(engine.config.max_model_len)}", file=sys.stderr,
          flush=True)
    base = {**driver.engine_config_record(engine), "seed": ns.seed,
            **driver.sampling_config(ns), "compile_cache_dir": ns.cache_dir}
    records: list[dict[str, Any]] = []
    rng = np.random.default_rng(ns.seed)

    ttft: dict[int, dict[str, float]] = {}
    one = [driver.params_of(ns, 1)]
    for L in ns.prompt_lens:
        driver.run_requests(engine, driver.random_prompts(rng, [L], cfg.vocab_size), one)
        before = driver.CompileState.of(engine)
        ms = []
        for _ in range(ns.repeats):
            [tl], _d = driver.run_requests(
                engine, driver.random_prompts(rng, [L], cfg.vocab_size), one)
            ms.append(1000.0 * tl.ttft if tl.ttft is not None else float("nan"))
        compiled = driver.CompileState.of(engine).since(before)["programs_compiled"]
        ttft[L] = {"ttft_ms_p50": float(np.median(ms)), "ttft_ms_min": min(ms),
                   "ttft_ms_max": max(ms), "programs_compiled": compiled}
        conf = {**base, "prompt_len": L, "repeats": ns.repeats}
        records += [make_record(f"bench_latency.ttft_ms_p50.prompt{L}", ttft[L]["ttft_ms_p50"],
                                "ms", {**conf, **ttft[L]})]
        print(f"TTFT {L} tokens: {ttft[L]['ttft_ms_p50']:.4g} ms", file=sys.stderr, flush=True)

    sweep: dict[int, dict[str, Any]] = {}
    ctx = isl + (osl + 1) // 2  # mean context of the decode steps
    for c in ns.concurrency:
        driver.warm_up(engine, isl, osl, c, ns.seed)
        before = driver.CompileState.of(engine)
        prompts = driver.random_prompts(rng, [isl] * c, cfg.vocab_size)
        tls, dur = driver.run_requests(
            engine, prompts, [driver.params_of(ns, osl)] * c,
            progress=Progress(f"latency c={c}", ns.progress_interval))
        s = summarize(tls, dur)
        s.update({f"run_{k}": v for k, v in driver.CompileState.of(engine).since(before).items()})
        step_s = s["itl_ms_p50"] / 1000.0
        if step_s > 0:
            cost = roofline.decode_step_cost(
                cfg, ctx, batch=c, dtype=engine.dtype, quantization=engine.config.quantization,
                kv_dtype=getattr(engine.kv_sizing, "kv_dtype", None))  # None: engine.dtype
            s.update(roofline.roofline(cost, step_s, *(
                (ceilings["copy_bytes_per_s"], ceilings["matmul_flops_per_s"])
                if ceilings else (None, None))))
        sweep[c] = s
        conf = {**base, "concurrency": c, "input_len": isl, "output_len": osl,
                "roofline_context": ctx, **(ceilings or {}),
                "completed": s["completed"], "errors": s["errors"],
                "programs_compiled_in_run": s["run_programs_compiled"]}
        for key, unit in (("output_throughput", "tok/s"), ("tpot_ms_p50", "ms"),
                          ("tpot_ms_p99", "ms"), ("itl_ms_p50", "ms"), ("itl_ms_p99", "ms"),
                          ("ttft_ms_p50", "ms"), ("bandwidth_frac", "fraction"),
                          ("matmul_frac", "fraction")):
            if key in s:
                records.append(make_record(f"bench_latency.{key}.c{c}", s[key], unit, conf))
    s_all = {**phases, **driver.memory_report()}
    records += [make_record(f"bench_latency.{k}", v, unit_of(k), base) for k, v in s_all.items()]
    path = write_run(f"bench_latency-{engine.model_name}", records, ns.out)
    print(f"records: {path}", file=sys.stderr, flush=True)
    print(format_table(table_rows(ttft, sweep, ceilings),
                       f"bench latency: {engine.model_name}, sweep ISL {isl} / OSL {osl}"))
    return {"ttft": ttft, "sweep": sweep, "ceilings": ceilings, "path": path}


def table_rows(ttft: dict[int, dict[str, float]], sweep: dict[int, dict[str, Any]],
               ceilings: dict[str, Any] | None) -> list[tuple[str, Any]]:
    """Rows of the printed latency table."""
    rows: list[tuple[str, Any]] = []
    for L, t in ttft.items():
        rows.append((f"TTFT {L}-token prompt (ms, median)", t["ttft_ms_p50"]))
    if ceilings:
        bw, mm = ceilings["copy_bytes_per_s"] / 1e9, ceilings["matmul_flops_per_s"] / 1e12
        rows.append((f"copy bandwidth / matmul rate ({ceilings['ceilings_source']})",
                     f"{bw:,.0f} GB/s, {mm:,.2f} TFLOP/s"))
    for c, s in sweep.items():
        line = (f"{s['output_throughput']:,.1f} tok/s, TPOT p50 {s['tpot_ms_p50']:.4g} ms, "
                f"ITL p50/p99 {s['itl_ms_p50']:.4g}/{s['itl_ms_p99']:.4g} ms")
        if s.get("bandwidth_frac") is not None:
            line += (f", {100 * s['bandwidth_frac']:.1f} % of copy bw, "
                     f"{100 * s['matmul_frac']:.2f} % of matmul")
        if s["run_programs_compiled"]:
            line += f" ({s['run_programs_compiled']} programs compiled in the run)"
        rows.append((f"{c} streams", line))
    return rows


def cmd_latency(ns: argparse.Namespace) -> int:
    r = run_latency(ns)
    bad = sum(s["errors"] + s["length_mismatches"] + s["unfinished"] for s in r["sweep"].values())
    return 0 if bad == 0 else 1
