"""CPU benchmark: greedy decode tok/s of jaxinfer vs HF transformers, same machine, same run.

    .venv/bin/python benchmarks/cpu_decode.py [--model smollm2-135m] [--batches 1 8]

Our side: the engine after warm-up (compilation excluded), decode steps timed one by one
(tokens come back to the host every step). Peer: HF transformers eager float32 in the
reference venv (scripts/setup_reference.sh), started as a subprocess in the same run.
Writes one JSON record per number to benchmarks/results/ and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import record  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def ours(model: str, batches: list[int], prompt_len: int, new: int) -> dict:
    from jaxinfer import LLM, SamplingParams
    from jaxinfer.loading import load_model

    # Prefix caching off: the warm-up and the timed run use the same prompts.
    llm = LLM(load_model(model, progress=False), max_num_seqs=max(batches), dtype="float32",
              enable_prefix_caching=False)
    eng = llm.engine
    rng = np.random.default_rng(0)
    prompts = rng.integers(100, 1000, (max(batches), prompt_len)).tolist()
    sp = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    res = {}
    for b in batches:
        llm.generate(prompts[:b], sp)  # warm-up: compiles this batch's buckets
        n_comp = eng.runner.num_compilations
        for p in prompts[:b]:
            eng.add_request(p, sp)
        step_times, decode_tokens, t_first = [], 0, None
        t0 = time.perf_counter()
        while eng.has_unfinished_requests():
            ts = time.perf_counter()
            outs = eng.step()
            dt = time.perf_counter() - ts
            if eng.scheduler.num_running and t_first is None and all(
                    len(o.outputs[0].token_ids) >= 1 for o in outs):
                t_first = time.perf_counter() - t0
            if outs and all(len(o.outputs[0].token_ids) > 1 for o in outs):
                step_times.append(dt)
                decode_tokens += len(outs)
        assert eng.runner.num_compilations == n_comp, "benchmark run compiled a program"
        decode_s = sum(step_times)
        res[f"b{b}"] = {"decode_tok_s": decode_tokens / decode_s, "ttft_s": t_first,
                        "tpot_ms": 1000 * float(np.median(step_times))}
    return res


def peer(model_path: Path, batches: list[int], prompt_len: int, new: int) -> dict | None:
    py = ROOT / ".venv-ref" / "bin" / "python"
    if not py.exists():
        print("peer skipped: no .venv-ref (run scripts/setup_reference.sh)", file=sys.stderr)
        return None
    cmd = [str(py), str(ROOT / "benchmarks" / "hf_decode_peer.py"), str(model_path.parent),
           model_path.name, str(prompt_len), str(new), *map(str, batches)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True,
                         env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ns = ap.parse_args()
    from jaxinfer.loading.named import resolve_named

    gguf = Path(resolve_named(ns.model))
    mine = ours(ns.model, ns.batches, ns.prompt_len, ns.new_tokens)
    hf = peer(gguf, ns.batches, ns.prompt_len, ns.new_tokens)
    cfg = {"model": ns.model, "prompt_len": ns.prompt_len, "new_tokens": ns.new_tokens,
           "dtype": "float32", "greedy": True}
    print(f"{'batch':>5} {'jaxinfer tok/s':>15} {'HF tok/s':>10} {'ratio':>7} "
          f"{'TPOT ms (ours)':>15} {'TPOT ms (HF)':>13}")
    for b in ns.batches:
        m = mine[f"b{b}"]
        record("cpu_decode_tok_s_jaxinfer", m["decode_tok_s"], "tok/s",
               {**cfg, "batch": b, "tpot_ms": m["tpot_ms"], "ttft_s": m["ttft_s"],
                "load_avg_1m": os.getloadavg()[0]})
        h = hf[f"b{b}"] if hf else None
        if h:
            record("cpu_decode_tok_s_hf_transformers", h["decode_tok_s"], "tok/s",
                   {**cfg, "batch": b, "tpot_ms": h["tpot_ms"], "torch": hf["torch"],
                    "threads": h["threads"], "load_avg_1m": os.getloadavg()[0]})
            record("cpu_decode_speedup_vs_hf", m["decode_tok_s"] / h["decode_tok_s"], "x",
                   {**cfg, "batch": b})
        print(f"{b:>5} {m['decode_tok_s']:>15.1f} {h['decode_tok_s'] if h else float('nan'):>10.1f}"
              f" {m['decode_tok_s'] / h['decode_tok_s'] if h else float('nan'):>7.2f}"
              f" {m['tpot_ms']:>15.1f} {h['tpot_ms'] if h else float('nan'):>13.1f}")


if __name__ == "__main__":
    main()
