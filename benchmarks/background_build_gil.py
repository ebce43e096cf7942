"""How long a background build of a k-step program keeps the engine's thread from the GIL.

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/background_build_gil.py --out benchmarks/results
        [--model smollm2-135m] [--k 8] [--switch-intervals 0.005,0.0005]

``engine_multi`` builds a new sampler variant's k-step program on a background thread
(``MultiStepPrograms.build_in_background``) while the engine's thread keeps stepping. Tracing
and lowering are Python; XLA's compile releases the GIL, but not every C++ call on the way
does. Here a thread lowers and compiles the top-p k-step program of ``--model`` at decode
bucket 8 while the main thread loops on a little Python work and ``time.sleep(0)`` (a step's
host code and its device wait); the longest gap between two iterations is the longest the
engine's thread would wait for the GIL. Each ``--switch-intervals`` value
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


def child(model: str, k: int, interval: float) -> dict:
    from jaxinfer.batch import Bucket
    from jaxinfer.engine import LLMEngine

    eng = LLMEngine(model, num_scheduler_steps=k, decode_buckets=(8,), max_num_seqs=8,
                    max_model_len=512)
    progs = eng.multi_step_programs
    bucket = Bucket("decode", 8, 8, eng.config.page_buckets[0])
    sys.setswitchinterval(interval)
    phase: dict[str, float] = {}

    def build() -> None:
        t = time.perf_counter()
        lowered = progs.lower(bucket, "top_p", k)
        phase["lower_s"] = time.perf_counter() - t
        t = time.perf_counter()
        lowered.compile()
        phase["compile_s"] = time.perf_counter() - t

    thread = threading.Thread(target=build)
    gaps: list[float] = []
    thread.start()
    last = time.perf_counter()
    while thread.is_alive():
        sum(range(200))
        time.sleep(0)
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
    gaps.sort()
    return {**phase, "max_gap_ms": 1e3 * gaps[-1], "p99_gap_ms": 1e3 * gaps[int(0.99 * len(gaps))],
            "iterations": len(gaps)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--switch-intervals", default="0.005,0.0005")
    p.add_argument("--child", type=float, default=None, help=argparse.SUPPRESS)
    ns = p.parse_args()
    if ns.child is not None:
        print("RESULT " + json.dumps(child(ns.model, ns.k, ns.child)), flush=True)
        return
    command = "JAX_PLATFORMS=cpu .venv/bin/python " + " ".join(sys.argv)
    for interval in (float(x) for x in ns.switch_intervals.split(",")):
        proc = subprocess.run([sys.executable, *sys.argv, "--child", str(interval)],
                              capture_output=True, text=True)
        line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        if proc.returncode or not line:
            raise SystemExit(f"switch interval {interval} failed:\n{proc.stderr[-3000:]}")
        r = json.loads(line[0][7:])
        cfg = {"model": ns.model, "k": ns.k, "switch_interval_s": interval, **r}
        record("background_build_max_gil_gap_ms", r["max_gap_ms"], "ms", cfg, ns.out, command)
        print(f"switch interval {interval * 1e3:g} ms: lower {r['lower_s']:.2f} s, compile "
              f"{r['compile_s']:.2f} s; main thread's longest wait {r['max_gap_ms']:.1f} ms, "
              f"p99 {r['p99_gap_ms']:.2f} ms ({r['iterations']} iterations)")


if __name__ == "__main__":
    main()
