"""Where the time of ``jaxinfer compile`` goes, from process start to exit (issue #5).

Runs ``python -m jaxinfer.cli compile ARGS -v`` in a fresh process (a new empty cache
directory each repeat), reads the ``phase NAME: S s`` lines the command logs at INFO (seconds
since its process started; see ``jaxinfer.compile.PhaseLog``) and adds the process's exit as
seen from outside. Prints one row per phase (median over repeats) and, with ``--record``,
writes the end-to-end seconds as a record under benchmarks/results/.

    PYTHONPATH=. python benchmarks/compile_phases.py --repeats 3 -- \\
        --model llama-3.1-8b --load-format dummy --max-model-len 64 --block-size 16 \\
        --max-num-seqs 1 --max-num-batched-tokens 16 --max-prefill-seqs 1 --jobs 2
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PHASE = re.compile(r"phase (.+): (-?[\d.]+) s$")


def run_once(args: list[str]) -> dict[str, float]:
    """Phase -> seconds since process start for one ``jaxinfer compile`` run, plus "exit"."""
    cache = tempfile.mkdtemp(prefix="compile-phases-")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    t0 = time.time()
    out = subprocess.run([sys.executable, "-m", "jaxinfer.cli", "compile", *args, "-v",
                          "--cache-dir", cache], capture_output=True, text=True, env=env,
                         cwd=ROOT, check=False)
    end = time.time() - t0
    shutil.rmtree(cache, ignore_errors=True)
    if out.returncode != 0:
        raise SystemExit(f"jaxinfer compile failed ({out.returncode}):\n{out.stderr[-3000:]}")
    marks: dict[str, float] = {}
    for line in out.stderr.splitlines():
        m = PHASE.search(line)
        if m:
            marks[m.group(1)] = float(m.group(2))
    marks["exit (seen from outside)"] = end
    return marks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--record", default=None,
                    help="write the end-to-end median as a record with this config label")
    ap.add_argument("args", nargs=argparse.REMAINDER, help="-- then `jaxinfer compile` args")
    ns = ap.parse_args()
    args = ns.args[1:] if ns.args[:1] == ["--"] else ns.args
    runs = [run_once(args) for _ in range(ns.repeats)]
    names = list(dict.fromkeys(k for r in runs for k in r))
    print(f"{'phase':45} {'s since start (median)':>22}  all")
    for k in names:
        vals = [r[k] for r in runs if k in r]
        print(f"{k:45} {statistics.median(vals):22.2f}  " + " ".join(f"{v:.2f}" for v in vals))
    if ns.record:
        sys.path.insert(0, str(ROOT))
        from jaxinfer.bench.records import record

        ends = [r["exit (seen from outside)"] for r in runs]
        phases = {k: statistics.median([r[k] for r in runs if k in r]) for k in names}
        rec = record("compile_end_to_end_s", statistics.median(ends), "s",
                          {"label": ns.record, "args": args, "repeats": ns.repeats,
                           "all": ends, "phases_median_s": phases},
                          command="PYTHONPATH=. python benchmarks/compile_phases.py "
                                  + " ".join(sys.argv[1:]))
        print(rec)


if __name__ == "__main__":
    main()
