"""Per-kernel time of one decode step, from a JAX profiler trace, summarised as text.

    PYTHONPATH=. python3 benchmarks/profile_decode.py --out $OUT
        [--model dummy:llama-3.1-8b] [--backend pallas[:fp8]] [--batch 1] [--ctx 512]
        [--steps 20] [--scan-layers auto|true|false] [--max-model-len N] [--host-profile]
        [--cache-dir DIR]

The engine compiles its programs one after the other (~20-30 s each for the 8B shape); with
--cache-dir it loads them from a cache filled first, in parallel, by
``jaxinfer compile --model llama-3.1-8b --load-format dummy --dtype bfloat16
--attention-backend pallas --max-model-len M --max-num-seqs B --decode-buckets B
--max-num-batched-tokens CTX --prefill-buckets CTX --max-prefill-seqs 1 --cache-dir DIR``.

Builds an LLMEngine as benchmarks/gpu_decode.py does, compiles the decode bucket, then traces
(``jax.profiler.trace(..., create_perfetto_trace=True)``) two phases:
1. device-only: the compiled decode program replayed ``--steps`` times on fixed inputs;
2. engine: ``--steps`` calls of ``LLMEngine.step()`` (scheduler, host arrays, token read-back).
For each phase it sums the device's kernel events (the trace's ``/device:*`` processes) per
kernel name and per class (GEMM, attention, XLA fusion, copy/memset, other), divided by the
number of steps, and reports device-busy time per step beside the wall time per step: the
difference is time the device sat idle (launch gaps, host work). Writes the table as text and
JSON under ``--out``; prints the table last. Parsing is ``summarise_trace`` (tested on CPU with
a synthetic trace; XLA:CPU traces have no device process).
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import apply_patches  # noqa: E402  (after the repo root is on the path)

CLASSES = [  # (class, regex on the kernel name), first match wins
    ("gemm", re.compile(r"gemm|cublas|cutlass|xmma|nvjet|sm90_|matmul|dot", re.I)),
    ("attention", re.compile(r"paged|attention|attn|flash", re.I)),
    ("copy", re.compile(r"memcpy|memset|copy|dynamic.update.slice|scatter", re.I)),
    ("fusion", re.compile(r"fusion|loop_|input_|reduce|transpose|convert|broadcast", re.I)),
]


def classify(name: str) -> str:
    for cls, rx in CLASSES:
        if rx.search(name):
            return cls
    return "other"


def load_trace(log_dir: str) -> list[dict]:
    """The traceEvents of the newest perfetto trace under log_dir."""
    paths = sorted(glob.glob(os.path.join(log_dir, "**", "perfetto_trace.json.gz"),
                             recursive=True), key=os.path.getmtime)
    if not paths:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {log_dir}")
    with gzip.open(paths[-1], "rt") as f:
        d = json.load(f)
    return d["traceEvents"] if isinstance(d, dict) else d


def summarise_trace(events: list[dict], steps: int, layers: int | None = None) -> dict:
    """Per-step kernel time by name and class from trace events of the device processes.

    Args:
      events: Chrome/perfetto trace events (``ph`` "M" metadata names processes; "X" events
        have ``ts`` and ``dur`` in microseconds).
      steps: decode steps inside the trace (divisor).
      layers: the model's decoder layers; with it, kernels called ``layers * p`` times a step
        (p > 1: one name for several calls a layer, e.g. the Mosaic GEMMs' anonymous name) are
        also timed by their position in the layer (the i-th call of a step is position
        ``i % p``), as ``by_position`` {name: [us per step, for each position]}.
    Returns:
      dict with ``kernels`` [(name, class, us_per_step, calls_per_step)] sorted by time,
      ``classes`` {class: us_per_step}, ``busy_us_per_step`` (union of kernel intervals over
      all device streams / steps), ``span_us_per_step`` (first kernel start to last kernel
      end / steps), ``device_pids``, and ``by_position`` where ``layers`` is given.
    Raises:
      ValueError: no device process in the trace.
    """
    dev = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
           and str(e.get("args", {}).get("name", "")).startswith("/device:")}
    if not dev:
        raise ValueError("no /device:* process in the trace (a CPU run has none)")
    ks = [e for e in events if e.get("ph") == "X" and e.get("pid") in dev and e.get("dur")]
    # Device processes hold kernels plus XLA-op / module rows on other threads; keep the
    # thread rows that are streams (the ones named "Stream"), else all.
    names = {(e["pid"], e.get("tid")): str(e.get("args", {}).get("name", ""))
             for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}
    streams = [e for e in ks if "stream" in names.get((e["pid"], e.get("tid")), "").lower()]
    ks = streams or ks
    per, cnt = collections.Counter(), collections.Counter()
    for e in ks:
        per[e["name"]] += e["dur"]
        cnt[e["name"]] += 1
    iv = sorted((e["ts"], e["ts"] + e["dur"]) for e in ks)
    busy, cur_s, cur_e = 0.0, None, None
    for s, t in iv:
        if cur_e is None or s > cur_e:
            busy += 0 if cur_e is None else cur_e - cur_s
            cur_s, cur_e = s, t
        else:
            cur_e = max(cur_e, t)
    busy += 0 if cur_e is None else cur_e - cur_s
    classes = collections.Counter()
    for n, us in per.items():
        classes[classify(n)] += us / steps
    kernels = sorted(((n, classify(n), us / steps, cnt[n] / steps) for n, us in per.items()),
                     key=lambda k: -k[2])
    out = {"kernels": kernels, "classes": dict(classes), "busy_us_per_step": busy / steps,
           "span_us_per_step": (iv[-1][1] - iv[0][0]) / steps if iv else 0.0,
           "device_pids": sorted(dev)}
    if layers:
        out["by_position"] = _by_position(ks, cnt, steps, layers)
    return out


def _by_position(ks: list[dict], cnt: collections.Counter, steps: int,
                 layers: int) -> dict[str, list[float]]:
    """{name: [us per step at each position in the layer]} for names called layers * p
    times a step (p > 1), calls ordered by start time."""
    res = {}
    for n, c in cnt.items():
        per_step, rem = divmod(c, steps)
        if rem or per_step % layers or per_step // layers < 2:
            continue
        p = per_step // layers
        pos = [0.0] * p
        for i, e in enumerate(sorted((e for e in ks if e["name"] == n), key=lambda e: e["ts"])):
            pos[(i % per_step) % p] += e["dur"] / steps
        res[n] = pos
    return res


def format_summary(title: str, s: dict, wall_ms: float, top: int = 25) -> str:
    lines = [f"== {title}: wall {wall_ms:.3f} ms/step, device busy "
             f"{s['busy_us_per_step'] / 1000:.3f} ms/step "
             f"({100 * s['busy_us_per_step'] / 1000 / wall_ms:.0f} % of wall), kernel span "
             f"{s['span_us_per_step'] / 1000:.3f} ms/step"]
    tot = sum(s["classes"].values())
    lines.append("  by class (us/step, % of kernel time): " + ", ".join(
        f"{c} {us:.0f} ({100 * us / tot:.0f}%)" for c, us in
        sorted(s["classes"].items(), key=lambda kv: -kv[1])))
    lines.append(f"  {'us/step':>9} {'calls':>6} {'class':>9}  kernel")
    for n, c, us, k in s["kernels"][:top]:
        lines.append(f"  {us:>9.1f} {k:>6.1f} {c:>9}  {n[:110]}")
    for n, pos in s.get("by_position", {}).items():
        lines.append(f"  by position in the layer (us/step): {n[:60]}: "
                     + ", ".join(f"[{i}] {us:.1f}" for i, us in enumerate(pos)))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/profile")
    ap.add_argument("--model", default="dummy:llama-3.1-8b")
    ap.add_argument("--backend", default="pallas", help="attention[:quantization]")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--scan-layers", choices=["auto", "true", "false"], default="auto")
    ap.add_argument("--max-model-len", type=int, default=None,
                    help="engine max_model_len (default ctx + 4 steps + 24; the bench suites "
                         "use 4352: 272-page block tables)")
    ap.add_argument("--cache-dir", default=None,
                    help="compile cache to load the programs from (fill it first with "
                         "`jaxinfer compile` and this engine's options, see the docstring)")
    ap.add_argument("--num-kv-pages", type=int, default=None,
                    help="KV pool pages (give the --cache-dir compile's value: the pool size is "
                         "part of the programs' fingerprint)")
    ap.add_argument("--host-profile", action="store_true",
                    help="after the traced phases, run --steps engine steps under cProfile and "
                         "write the top functions by own time (host_profile.txt)")
    ap.add_argument("--top", type=int, default=25, help="kernels listed per phase in the text")
    ap.add_argument("--synthetic", action="store_true",
                    help="no prompts: compile the decode bucket and replay it with each row at "
                         "--ctx on its own pages (KV contents random); device-only phase only")
    ap.add_argument("--patch", action="append", default=[], metavar="MODULE.NAME=VALUE",
                    help="set a module constant before the engine is built (an A/B of a plan "
                         "constant, as in gpu_decode.py); recorded in the summary")
    ns = ap.parse_args()
    patches = apply_patches(ns.patch, "profile_decode")
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.85")
    import jax
    import numpy as np

    from benchmarks.gpu_decode import decode_replay, make_engine
    from jaxinfer import SamplingParams

    scan = {"auto": None, "true": True, "false": False}[ns.scan_layers]
    b = ns.batch
    extra = {"max_model_len": ns.max_model_len} if ns.max_model_len else {}
    if ns.cache_dir:
        extra["compile_cache_dir"] = ns.cache_dir
    if ns.num_kv_pages:
        extra["num_kv_pages"] = ns.num_kv_pages
    eng = make_engine(ns.model, ns.backend, [b], ns.ctx, 4 * ns.steps + 8, scan, **extra)
    print(f"[{time.perf_counter():.0f}] engine ready; programs compiled so far: "
          f"{eng.runner.num_compilations}", flush=True)
    rng = np.random.default_rng(0)
    # Long enough that the first sequences are still running once the last is admitted (the
    # scheduler interleaves their decode steps with the other prompts' prefills: with
    # max_tokens below b, the first ones finished before all b ran and the wait never ended).
    sp = SamplingParams(temperature=0.0, ignore_eos=True,
                        max_tokens=2 * b + (5 if ns.host_profile else 4) * ns.steps + 16)
    if ns.synthetic:
        from jaxinfer.batch import Bucket

        pages = eng.config.page_buckets[-1]
        if b * ((ns.ctx + 1) // 16 + 1) >= eng.kv_sizing.num_pages:
            raise SystemExit(f"--synthetic: {b} rows x {ns.ctx} tokens exceed the KV pool")
        eng.runner.executable(Bucket("decode", b, b, pages))
        print(f"[{time.perf_counter():.0f}] decode bucket compiled", flush=True)
    else:
        for _ in range(b):
            eng.add_request(rng.integers(0, eng.model_config.vocab_size, ns.ctx).tolist(), sp)
        while not all(s.num_output_tokens > 2 for s in eng.scheduler.running) \
                or len(eng.scheduler.running) < b:
            eng.step()  # prefill + first decode steps: everything compiled
            if not eng.has_unfinished_requests():
                raise SystemExit("every request finished before all rows ran together")
        print(f"[{time.perf_counter():.0f}] {b} rows decoding; programs compiled: "
              f"{eng.runner.num_compilations}", flush=True)
    report, summary = [], {"config": vars(ns), "device": jax.devices()[0].device_kind,
                           "patches": {k: repr(v) for k, v in patches.items()}}
    replay = decode_replay(eng, b, ns.ctx, distinct=ns.synthetic)
    jax.block_until_ready(replay())
    for phase in ("device-only",) if ns.synthetic else ("device-only", "engine"):
        d = tempfile.mkdtemp(prefix="trace_")
        with jax.profiler.trace(d, create_perfetto_trace=True):
            t0 = time.perf_counter()
            for _ in range(ns.steps):
                if phase == "device-only":
                    r = replay()
                else:
                    eng.step()
            jax.block_until_ready(r if phase == "device-only" else eng.runner.cache)
            wall_ms = 1000 * (time.perf_counter() - t0) / ns.steps
        try:
            s = summarise_trace(load_trace(d), ns.steps,
                                eng.model_config.num_layers)
        except (ValueError, FileNotFoundError) as e:
            report.append(f"== {phase}: wall {wall_ms:.3f} ms/step; no kernel summary: {e}")
            continue
        summary[phase] = {"wall_ms_per_step": wall_ms, **s}
        report.append(format_summary(phase, s, wall_ms, ns.top))
    if ns.host_profile and not ns.synthetic:
        import cProfile
        import io
        import pstats

        pr = cProfile.Profile()
        t0 = time.perf_counter()
        pr.enable()
        for _ in range(ns.steps):
            eng.step()
        pr.disable()
        jax.block_until_ready(eng.runner.cache)
        wall_ms = 1000 * (time.perf_counter() - t0) / ns.steps
        buf = io.StringIO()
        pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(30)
        (out / "host_profile.txt").write_text(f"wall {wall_ms:.3f} ms/step under cProfile\n"
                                              + buf.getvalue())
        summary["host_profile_wall_ms_per_step"] = wall_ms
        report.append(f"== engine under cProfile: wall {wall_ms:.3f} ms/step; top functions "
                      f"by own time in host_profile.txt")
        report.extend(buf.getvalue().splitlines()[:22])
    (out / "profile_summary.json").write_text(json.dumps(summary, indent=1, default=str))
    text = "\n".join(report)
    (out / "profile_summary.txt").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
