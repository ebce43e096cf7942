"""What a busy Python thread costs a loop that keeps giving the GIL up, by switch interval.

    python3 benchmarks/gil_handback.py --out benchmarks/results [--releases 50]
        [--switch-intervals 0.005,0.001,0.0005]

The engine's step gives the GIL up at every launch, device wait and transfer; while a
k-step program traces on a background thread (runner_multi.MultiStepPrograms
.build_in_background) the step gets it back only when the builder's switch interval runs
out. Here a "step" is ``--releases`` calls of ``time.sleep(0.0001)`` (each releases the GIL);
timed alone and beside a thread running a pure-Python loop, at each switch interval. Prints
one line per interval; one JSON record per interval (the step's best time beside the busy
thread; ``config`` holds the rest).
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.common import record  # noqa: E402


def _busy(stop: threading.Event) -> None:
    x = 0
    while not stop.is_set():
        for i in range(1000):
            x += i


def _step(releases: int) -> float:
    t = time.perf_counter()
    for _ in range(releases):
        time.sleep(0.0001)
    return time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--releases", type=int, default=50)
    p.add_argument("--switch-intervals", default="0.005,0.001,0.0005")
    p.add_argument("--repeats", type=int, default=5)
    ns = p.parse_args()
    command = "python3 " + " ".join(sys.argv)
    for interval in (float(x) for x in ns.switch_intervals.split(",")):
        sys.setswitchinterval(interval)
        alone = [_step(ns.releases) for _ in range(ns.repeats)]
        stop = threading.Event()
        thread = threading.Thread(target=_busy, args=(stop,))
        thread.start()
        time.sleep(0.05)
        beside = [_step(ns.releases) for _ in range(ns.repeats)]
        stop.set()
        thread.join()
        cfg = {"releases": ns.releases, "switch_interval_s": interval,
               "alone_ms": [round(1e3 * t, 2) for t in alone],
               "beside_busy_thread_ms": [round(1e3 * t, 2) for t in beside]}
        record("gil_handback_step_ms", 1e3 * min(beside), "ms", cfg, ns.out, command)
        print(f"switch interval {interval * 1e3:g} ms: a step of {ns.releases} GIL releases "
              f"{1e3 * min(alone):.1f} ms alone, {1e3 * min(beside):.1f}-"
              f"{1e3 * max(beside):.1f} ms beside a busy thread")


if __name__ == "__main__":
    main()
