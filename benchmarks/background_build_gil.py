"""How long a background build of a k-step program keeps the engine's thread from the GIL.

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/background_build_gil.py --out benchmarks/results
        [--model smollm2-135m] [--k 8] [--switch-intervals 0.005,0.0005] [--separate]
        [--gc-freeze]

``engine_multi`` builds a new sampler variant's k-step program on a background thread
(``MultiStepPrograms.build_in_background``) while the engine's thread keeps stepping. Tracing
and lowering are Python; XLA's compile releases the GIL, but not every C++ call on the way
does. Here a thread lowers and compiles the top-p k-step program of ``--model`` at decode
bucket 8 while the main thread loops on a little Python work and ``time.sleep(0)`` (a step's
host code and its device wait); the longest gap between two iterations is the longest the
engine's thread would wait for the GIL; each gap is counted in the phase (lowering or
compile) it ended in. ``--separate`` is the control: the same build in a worker process (its
own GIL; set-up included), so what gaps remain there are the machine's CPU contention, not
the GIL. Each ``--switch-intervals`` value
(``sys.setswitchinterval``) in a fresh process. Prints one line each; one JSON record each
(benchmarks/common.record).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.common import record  # noqa: E402


def _engine_and_bucket(model: str, k: int):
    from jaxinfer.batch import Bucket
    from jaxinfer.engine import LLMEngine

    eng = LLMEngine(model, num_scheduler_steps=k, decode_buckets=(8,), max_num_seqs=8,
                    max_model_len=512)
    return eng, Bucket("decode", 8, 8, eng.config.page_buckets[0])


def build_only(model: str, k: int) -> dict:
    """The same build in this (worker) process: seconds of the set-up, lowering, compile."""
    t0 = time.perf_counter()
    eng, bucket = _engine_and_bucket(model, k)
    t1 = time.perf_counter()
    lowered = eng.multi_step_programs.lower(bucket, "top_p", k)
    t2 = time.perf_counter()
    lowered.compile()
    return {"setup_s": t1 - t0, "lower_s": t2 - t1, "compile_s": time.perf_counter() - t2}


def child(model: str, k: int, interval: float, separate: bool, freeze: bool) -> dict:
    import gc

    eng, bucket = _engine_and_bucket(model, k)
    progs = eng.multi_step_programs
    if freeze:  # what a server does after its warm-up (jaxinfer.warmup.freeze_gc_heap)
        gc.collect()
        gc.freeze()
    sys.setswitchinterval(interval)
    phase: dict[str, float] = {}

    def build() -> None:
        if separate:  # the control: the build in another process, its own GIL
            t = phase["lower_start"] = phase["compile_start"] = time.perf_counter()
            proc = subprocess.run([sys.executable, __file__, "--out", "-", "--model", model,
                                   "--k", str(k), "--build-only"], capture_output=True,
                                  text=True)
            line = [x for x in proc.stdout.splitlines() if x.startswith("BUILT ")]
            if proc.returncode or not line:
                raise SystemExit(f"the worker build failed:\n{proc.stderr[-3000:]}")
            phase.update(json.loads(line[0][6:]), wall_s=time.perf_counter() - t)
            return
        t = phase["lower_start"] = time.perf_counter()
        lowered = progs.lower(bucket, "top_p", k)
        phase["lower_s"] = time.perf_counter() - t
        t = phase["compile_start"] = time.perf_counter()
        lowered.compile()
        phase["compile_s"] = time.perf_counter() - t

    thread = threading.Thread(target=build)
    gaps: list[tuple[float, float]] = []  # (gap, when it ended)
    stacks: list[str] = []
    thread.start()
    last = time.perf_counter()
    while thread.is_alive():
        sum(range(200))
        time.sleep(0)
        now = time.perf_counter()
        gaps.append((now - last, now))
        if now - last > 0.02:  # where the build thread is as the main thread gets back in
            f = sys._current_frames().get(thread.ident)
            stacks.append(f"{1e3 * (now - last):.0f} ms: " + (
                f"{f.f_code.co_filename}:{f.f_lineno} {f.f_code.co_name}" if f else "?"))
            now = time.perf_counter()  # the look is not part of the next gap
        last = now
    # Which phase each gap fell in (a gap ending after compile started is the compile's).
    by_phase = {"lower": [g for g, t in gaps if t < phase["compile_start"]],
                "compile": [g for g, t in gaps if t >= phase["compile_start"]]}
    times = sorted(g for g, _ in gaps)
    out = {**{x: phase[x] for x in ("setup_s", "wall_s") if x in phase},
           "lower_s": phase["lower_s"], "compile_s": phase["compile_s"],
           "max_gap_ms": 1e3 * times[-1], "p99_gap_ms": 1e3 * times[int(0.99 * len(times))],
           "iterations": len(times)}
    for name, gs in by_phase.items():
        out[f"max_gap_{name}_ms"] = 1e3 * max(gs, default=0.0)
        out[f"gaps_over_20ms_{name}"] = sum(g > 0.02 for g in gs)
    out["gaps_over_20ms_where"] = stacks
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--switch-intervals", default="0.005,0.0005")
    p.add_argument("--separate", action="store_true",
                   help="the control: build in a worker process instead of a thread")
    p.add_argument("--gc-freeze", action="store_true",
                   help="gc.collect() + gc.freeze() after the engine is built, as a server "
                        "after its warm-up")
    p.add_argument("--child", type=float, default=None, help=argparse.SUPPRESS)
    p.add_argument("--build-only", action="store_true", help=argparse.SUPPRESS)
    ns = p.parse_args()
    if ns.build_only:
        print("BUILT " + json.dumps(build_only(ns.model, ns.k)), flush=True)
        return
    if ns.child is not None:
        print("RESULT " + json.dumps(child(ns.model, ns.k, ns.child, ns.separate,
                                           ns.gc_freeze)), flush=True)
        return
    command = "JAX_PLATFORMS=cpu .venv/bin/python " + " ".join(sys.argv)
    for interval in (float(x) for x in ns.switch_intervals.split(",")):
        proc = subprocess.run([sys.executable, *sys.argv, "--child", str(interval)],
                              capture_output=True, text=True)
        line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        if proc.returncode or not line:
            raise SystemExit(f"switch interval {interval} failed:\n{proc.stderr[-3000:]}")
        r = json.loads(line[0][7:])
        cfg = {"model": ns.model, "k": ns.k, "switch_interval_s": interval,
               "build_in": "worker process" if ns.separate else "thread",
               "gc_freeze": ns.gc_freeze, **r}
        record("background_build_max_gil_gap_ms", r["max_gap_ms"], "ms", cfg, ns.out, command)
        print(f"switch interval {interval * 1e3:g} ms: lower {r['lower_s']:.2f} s, compile "
              f"{r['compile_s']:.2f} s; main thread's longest wait {r['max_gap_ms']:.1f} ms "
              f"(in lowering {r['max_gap_lower_ms']:.1f}, in compile "
              f"{r['max_gap_compile_ms']:.1f}; > 20 ms: {r['gaps_over_20ms_lower']} / "
              f"{r['gaps_over_20ms_compile']}), p99 {r['p99_gap_ms']:.2f} ms "
              f"({r['iterations']} iterations)")
        for where in r["gaps_over_20ms_where"]:
            print("   build thread after a gap of", where)


if __name__ == "__main__":
    main()
