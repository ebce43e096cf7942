"""Start-up on the GPU: compile the 8B bucket set ahead of time, then time cold and warm starts.

    PYTHONPATH=. python3 benchmarks/startup_gpu.py --out $OUT
        [--model dummy:llama-3.1-8b] [--variants bf16,fp8,bf16+scan] [--jobs 8] [--skip-cold]
        [--max-num-seqs 8] [--max-model-len 2048] [--max-num-batched-tokens 512]

For each variant (bf16; fp8 = FP8 e4m3 projection weights; "+scan" = layers under lax.scan,
whose compile time does not grow with depth, instead of the default unrolled layers):
1. ``jaxinfer compile`` of the whole bucket set into a fresh cache directory: wall seconds,
   program count, per-program compile seconds (from the manifest). Target: <= 60 s for 8B.
2. warm start: a fresh process ``LLM(model, compile_cache_dir=...)`` (strict) to its first
   token and to 32 tokens of a 16-token prompt, with the programs it compiled (must be 0) and
   loaded, then the seconds to load the rest of the bucket set. Target: first token <= 10 s.
3. cold start (unless ``--skip-cold``): the same without the cache (compiles what it needs).

Prints a table; writes one JSON record per number into ``--out`` (benchmarks/common.record).
Dummy weights are generated on the host (a memory copy) and moved to the device; that time is
reported separately ("weights+engine") from program loading.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.common import record


def variant_flags(v: str) -> tuple[list[str], dict]:
    """CLI flags and LLM kwargs of a variant such as "fp8+scan"."""
    base, _, scan = v.partition("+")
    if base not in ("bf16", "fp8") or scan not in ("", "scan"):
        raise SystemExit(f"unknown variant {v!r}: use bf16 or fp8, optionally +scan")
    flags = ["--quantization", "fp8"] if base == "fp8" else []
    kw: dict = {"quantization": "fp8" if base == "fp8" else None}
    if scan:
        flags += ["--scan-layers", "true"]
        kw["scan_layers"] = True
    return flags, kw


def child(a: dict) -> dict:
    """A fresh process: engine start to first token and to 32 tokens, then load the rest."""
    t_import0 = time.time()
    import jax

    from jaxinfer.llm import LLM
    from jaxinfer.sampling_params import SamplingParams

    t_import = time.time()
    kw = dict(a["engine"])
    if a["cache"]:
        kw.update(compile_cache_dir=a["cache"], compile_cache_strict=True)
    llm = LLM(a["model"], **kw)
    t_engine = time.time()
    eng = llm.engine
    rid = eng.add_request(list(range(100, 116)),
                          SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    t_first = None
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.request_id == rid and o.outputs[0].token_ids and t_first is None:
                t_first = time.time()
    t_done = time.time()
    r = eng.runner
    out = {"t_import0": t_import0, "t_import": t_import, "t_engine": t_engine,
           "t_first": t_first, "t_done": t_done, "compiled": r.num_compilations,
           "loaded": r.num_loaded, "device": str(jax.devices()[0].device_kind),
           "start_seconds": getattr(eng, "start_seconds", {})}
    if a["cache"]:
        from jaxinfer.compile import preload

        t0 = time.time()
        out["programs_total"] = preload(eng)
        out["preload_s"] = time.time() - t0
    return out


def run(cmd: list[str], env: dict) -> tuple[subprocess.CompletedProcess, float]:
    """Run cmd; its stderr (progress bars, logs) goes to ours as it comes, stdout is kept."""
    print("+", " ".join(cmd)[:300], flush=True)
    t0 = time.time()
    p = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT, check=False)
    if p.returncode:
        raise RuntimeError(f"{' '.join(cmd)[:300]} failed with exit code {p.returncode} "
                           "(its stderr is above)")
    return p, t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", required=False, default=None, help="directory for JSON records")
    ap.add_argument("--model", default="dummy:llama-3.1-8b")
    ap.add_argument("--variants", default="bf16,fp8,bf16+scan")
    ap.add_argument("--jobs", type=int, default=8, help="compile worker processes")
    ap.add_argument("--cache-root", default=None, help="where the caches go (default: a tmp dir)")
    ap.add_argument("--skip-cold", action="store_true")
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ns = ap.parse_args()
    if ns.child:
        import warnings

        warnings.simplefilter("ignore")
        print(json.dumps(child(json.loads(ns.child))))
        return
    out_dir = Path(ns.out) if ns.out else None
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    root = Path(ns.cache_root or tempfile.mkdtemp(prefix="jaxinfer-startup-"))
    engine_flags = ["--max-num-seqs", str(ns.max_num_seqs), "--max-model-len",
                    str(ns.max_model_len), "--max-num-batched-tokens",
                    str(ns.max_num_batched_tokens), "--dtype", "bfloat16"]
    rows = []
    for v in ns.variants.split(","):
        flags, kw = variant_flags(v)
        cache = root / f"{ns.model.replace(':', '_')}-{v.replace('+', '-')}"
        engine = {"max_num_seqs": ns.max_num_seqs, "max_model_len": ns.max_model_len,
                  "max_num_batched_tokens": ns.max_num_batched_tokens, "dtype": "bfloat16",
                  **kw}
        cfg = {"model": ns.model, "variant": v, **engine, "jobs": ns.jobs}

        p, t0 = run([sys.executable, "-m", "jaxinfer.cli", "compile", "--model", ns.model,
                     *engine_flags, *flags, "--cache-dir", str(cache),
                     "--jobs", str(ns.jobs), "--force"], env)
        compile_wall = time.time() - t0
        manifest = json.loads((cache / "manifest.json").read_text())
        secs = [e["compile_seconds"] for e in manifest["programs"]]
        n = len(secs)
        record("gpu_compile_bucket_set_wall", compile_wall, "s", dict(cfg, programs=n),
               out_dir)
        record("gpu_compile_seconds_per_program_max", max(secs), "s", dict(cfg, programs=n),
               out_dir)
        record("gpu_compile_seconds_per_program_mean", sum(secs) / n, "s",
               dict(cfg, programs=n), out_dir)
        row = {"variant": v, "programs": n, "compile_wall": compile_wall,
               "compile_mean": sum(secs) / n, "compile_max": max(secs)}

        for mode in ("warm",) if ns.skip_cold else ("warm", "cold"):
            arg = {"model": ns.model, "engine": engine, "cache": str(cache) if mode == "warm"
                   else ""}
            p, t0 = run([sys.executable, __file__, "--child", json.dumps(arg)], env)
            r = json.loads(p.stdout.strip().splitlines()[-1])
            ttft, done = r["t_first"] - t0, r["t_done"] - t0
            c = dict(cfg, mode=mode, compiled=r["compiled"], loaded=r["loaded"])
            record("gpu_startup_time_to_first_token", ttft, "s", c, out_dir)
            record("gpu_startup_time_to_32_tokens", done, "s", c, out_dir)
            record("gpu_startup_weights_and_engine", r["t_engine"] - r["t_import"], "s", c,
                   out_dir)
            for phase, sec in r["start_seconds"].items():  # LLMEngine.start_seconds
                record(f"gpu_startup_engine_{phase}", sec, "s", c, out_dir)
                row[f"{mode}_{phase}"] = sec
            row[f"{mode}_ttft"] = ttft
            row[f"{mode}_imports"] = r["t_import"] - t0
            row[f"{mode}_engine"] = r["t_engine"] - r["t_import"]
            row[f"{mode}_first"] = r["t_first"] - r["t_engine"]
            row[f"{mode}_compiled"], row[f"{mode}_loaded"] = r["compiled"], r["loaded"]
            row["device"] = r["device"]
            if mode == "warm":
                row["preload"] = r["preload_s"]
                record("gpu_startup_load_all_programs", r["preload_s"], "s",
                       dict(c, programs=r["programs_total"]), out_dir)
        rows.append(row)
        print(json.dumps(row), flush=True)

    print(f"\n{ns.model} on {rows[0].get('device', '?')}, caches under {root}")
    print(f"{'variant':9} {'progs':>6} {'compile wall':>12} {'mean/max per prog':>18} "
          f"{'warm TTFT':>9} {'(imports/weights+engine/prefill)':>32} {'compiled':>8} "
          f"{'load rest':>9} {'cold TTFT':>9}")
    for r in rows:
        split = f"{r['warm_imports']:.1f}/{r['warm_engine']:.1f}/{r['warm_first']:.2f}"
        cold = f"{r['cold_ttft']:9.1f}" if "cold_ttft" in r else f"{'-':>9}"
        print(f"{r['variant']:9} {r['programs']:6d} {r['compile_wall']:11.1f}s "
              f"{r['compile_mean']:8.2f}/{r['compile_max']:.2f} s {r['warm_ttft']:8.1f}s "
              f"{split:>32} {r['warm_compiled']:8d} {r['preload']:8.1f}s {cold}")
    for r in rows:  # the warm start without the weights (issue #5's measure)
        if "warm_read_weights" in r:
            rest = r["warm_ttft"] - r["warm_read_weights"] - r["warm_weights_to_device"]
            print(f"{r['variant']}: warm TTFT {r['warm_ttft']:.1f} s = weights read "
                  f"{r['warm_read_weights']:.1f} + weights to device "
                  f"{r['warm_weights_to_device']:.1f} + the rest {rest:.1f} s (imports, KV "
                  f"pool {r['warm_kv_pool']:.1f}, cache open {r['warm_compile_cache_open']:.1f},"
                  f" first token)")
    print("targets: compile wall <= 60 s (8B), warm TTFT <= 10 s, warm compiled == 0")


if __name__ == "__main__":
    main()
