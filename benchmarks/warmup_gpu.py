"""A server's warm-up at the engine's default batch limits, serial vs a pool of threads.

    PYTHONPATH=. python3 benchmarks/warmup_gpu.py --out $OUT [--model llama-3.1-8b]
        [--jobs 1,8] [--quantization fp8] [--child-timeout 280] [--prefill]

Each ``--jobs`` value runs in a fresh process (XLA keeps autotuning results in memory, so a
second warm-up in one process would be faster for the wrong reason): an engine with random
weights at ``--model``'s shape and the engine's own defaults for the batch limits (on a GPU
256 sequences, 8192 prefill tokens; engine_config.GPU_DEFAULTS), then
``jaxinfer.warmup.warm_up(engine, jobs=J)`` as ``jaxinfer serve`` runs it before it says
SERVING (``--prefill``: as ``serve --warmup-prefill`` runs it): the seconds, the programs
compiled / loaded, the largest per-program build time.
Then, as a check that the threads built the right programs, 64 greedy requests of 96 prompt
tokens / 24 new tokens: the programs built after warm-up (none where the warm-up built the
prefill programs too; else the prefill buckets of the batch) and the first tokens of
request 0 (equal across ``--jobs`` values: same weights, seed 0). Last, the largest decode
and prefill programs are compiled again alone and their optimized HLO compared with the
warm-up's (autotuning beside other compiles could pick other GEMM algorithms).

Prints a table; writes one JSON record per number into ``--out`` (benchmarks/common.record).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.common import record  # noqa: E402


def same_as_alone(r, ec) -> dict:
    """Whether the largest decode and prefill programs the warm-up built (compiled beside
    others, their GEMM autotuning sharing the GPU) equal the same programs compiled again
    alone on the idle GPU: {program: True or the count of differing lines of the optimized
    HLO} (autotuning picks are in its backend configs)."""
    from jaxinfer.batch import Bucket
    from jaxinfer.runner import COMPILER_OPTIONS, SAMPLE

    keys = [(SAMPLE, Bucket("decode", ec.decode_buckets[-1], ec.decode_buckets[-1],
                            ec.page_buckets[0]))]
    keys += [k for k in r._executables if k[0] == SAMPLE and k[1].kind == "prefill"
             and k[1].num_tokens == ec.prefill_buckets[-1]][:1]
    out = {}
    for mode, b in keys:
        built = r._executables[mode, b].as_text()
        alone = r.lower(b, mode).compile(compiler_options=COMPILER_OPTIONS).as_text()
        diff = sum(x != y for x, y in zip(built.splitlines(), alone.splitlines()))
        diff += abs(len(built.splitlines()) - len(alone.splitlines()))
        out[f"{b.kind}:{b.num_tokens}x{b.num_seqs}"] = True if built == alone else diff
    return out


def child(model: str, jobs: int, quantization: str | None, prefill: bool) -> dict:
    """One process: engine, warm-up with ``jobs`` threads, a greedy batch after it."""
    t0 = time.perf_counter()
    import jax

    from jaxinfer.engine import LLMEngine
    from jaxinfer.sampling_params import SamplingParams
    from jaxinfer.warmup import warm_up

    engine = LLMEngine(f"dummy:{model}", quantization=quantization)
    t_engine = time.perf_counter() - t0
    ec, r = engine.config, engine.runner
    warm_s = warm_up(engine, jobs=jobs, prefill_buckets=prefill)
    warm = (r.num_compilations, r.num_loaded)
    builds = sorted(r.compile_seconds.values(), reverse=True)
    keys_after_warm = set(r._executables)
    V = engine.model_config.vocab_size
    t1 = time.perf_counter()
    ids = []
    for i in range(64):
        prompt = [(7 * i + 13 * j + 1) % V for j in range(96)]
        ids.append(engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=24,
                                                             ignore_eos=True)))
    first_tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == ids[0] and out.finished:
                first_tokens = list(out.outputs[0].token_ids[:8])
    batch_s = time.perf_counter() - t1
    new = sorted({f"{m}:{b.kind}:{b.num_tokens}x{b.num_seqs}"
                  for m, b in set(r._executables) - keys_after_warm})
    same_code = same_as_alone(r, ec)
    return {"jobs": jobs, "prefill_warmed": prefill,
            "engine_s": t_engine, "engine_phases_s": engine.start_seconds,
            "warm_up_s": warm_s,
            "compiled": warm[0], "loaded": warm[1], "programs": len(keys_after_warm),
            "slowest_build_s": builds[:3], "max_num_seqs": ec.max_num_seqs,
            "max_num_batched_tokens": ec.max_num_batched_tokens,
            "decode_buckets": list(ec.decode_buckets),
            "prefill_buckets": list(ec.prefill_buckets), "num_kv_pages": r.num_pages,
            "batch_64x96x24_s": batch_s, "built_after_warm_up": new,
            "first_tokens_req0": first_tokens, "same_code_as_alone": same_code,
            "device": str(jax.devices()[0].device_kind),
            "jax": jax.__version__}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--jobs", default="1,8")
    ap.add_argument("--quantization", choices=["fp8"], default=None)
    ap.add_argument("--child-timeout", type=float, default=280)
    ap.add_argument("--prefill", action="store_true",
                    help="the warm-up builds every prefill program too (serve --warmup-prefill)")
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child is not None:
        print("RESULT " + json.dumps(child(a.model, a.child, a.quantization, a.prefill)),
              flush=True)
        return 0
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for jobs in [int(j) for j in a.jobs.split(",")]:
        cmd = [sys.executable, __file__, "--out", a.out, "--model", a.model, "--child", str(jobs)]
        if a.quantization:
            cmd += ["--quantization", a.quantization]
        if a.prefill:
            cmd.append("--prefill")
        t0 = time.perf_counter()
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=a.child_timeout)
        except subprocess.TimeoutExpired:
            print(f"jobs {jobs}: timed out after {a.child_timeout} s", flush=True)
            continue
        lines = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
        if p.returncode or not lines:
            print(f"jobs {jobs}: rc {p.returncode}\n{p.stderr[-3000:]}", flush=True)
            continue
        res = json.loads(lines[-1][7:])
        res["process_s"] = time.perf_counter() - t0
        rows.append(res)
        cfg = {k: v for k, v in res.items() if k not in ("warm_up_s", "device", "jax")}
        cfg.update(model=f"dummy:{a.model}", quantization=a.quantization)
        record("warm_up_seconds", round(res["warm_up_s"], 2), "s", cfg, out,
               command=" ".join(["python3", "benchmarks/warmup_gpu.py"] + sys.argv[1:]))
        print(json.dumps(res), flush=True)
    print(f"\n{'jobs':>4} {'warm-up s':>9} {'compiled':>8} {'loaded':>6} {'slowest s':>9} "
          f"{'engine s':>8} {'batch s':>7}  built after warm-up / first tokens")
    for x in rows:
        print(f"{x['jobs']:>4} {x['warm_up_s']:>9.1f} {x['compiled']:>8} {x['loaded']:>6} "
              f"{x['slowest_build_s'][0]:>9.1f} {x['engine_s']:>8.1f} "
              f"{x['batch_64x96x24_s']:>7.1f}  {x['built_after_warm_up']} "
              f"{x['first_tokens_req0']}")
    for x in rows:
        print(f"jobs {x['jobs']}: programs equal to the same compiled alone: "
              f"{x['same_code_as_alone']}")
    same = len({tuple(x["first_tokens_req0"]) for x in rows}) <= 1
    print(f"first tokens equal across jobs: {same}")
    return 0 if rows and same else 1


if __name__ == "__main__":
    raise SystemExit(main())
