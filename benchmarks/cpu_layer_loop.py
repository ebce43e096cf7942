"""CPU: decode step time with the layers scanned vs unrolled (SmolLM2, float32).

    .venv/bin/python benchmarks/cpu_layer_loop.py [--model smollm2-135m] [--rounds 3]

The two engines alternate (A/B, --rounds times) so machine load hits both alike; each round
times the decode steps of one 32-token greedy request (median, compilation excluded). One
JSON record per variant (median over rounds) in benchmarks/results/.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import record  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rounds", type=int, default=3)
    ns = ap.parse_args()
    from jaxinfer import LLM, SamplingParams
    from jaxinfer.loading import load_model

    m = load_model(ns.model, progress=False)
    sp = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    llms = {scan: LLM(m, scan_layers=scan, max_num_seqs=1, max_model_len=512,
                      dtype="float32", enable_prefix_caching=False) for scan in (True, False)}
    for llm in llms.values():
        llm.generate([[5] * 20], sp)  # warm-up: compiles the programs
    res: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(ns.rounds):
        for scan, llm in llms.items():
            eng = llm.engine
            eng.add_request([7] * 20, sp)
            ts = []
            while eng.has_unfinished_requests():
                t0 = time.perf_counter()
                eng.step()
                ts.append(time.perf_counter() - t0)
            res[scan].append(1000 * float(np.median(ts[2:])))  # decode steps only
    for scan, v in res.items():
        name = "scanned" if scan else "unrolled"
        record("cpu_decode_step_ms_layer_loop", float(np.median(v)), "ms/step",
               {"model": ns.model, "layers": name, "batch": 1, "dtype": "float32",
                "rounds_ms": v, "load_avg_1m": os.getloadavg()[0]})
        print(f"{name:>9}: {np.median(v):.1f} ms/step (rounds {[round(x, 1) for x in v]})")


if __name__ == "__main__":
    main()
