"""Start-up on the CPU: how to load precompiled programs, cold vs warm start, compile vs depth.

    PYTHONPATH=. python benchmarks/startup_cpu.py [--parts methods,start,cli,depth]
        [--model smollm2-135m] [--cache-dir DIR] [--repeats 2]

* methods: load the same few programs of ``--model`` in a fresh process by (a) compiling
  (no cache), (b) JAX's persistent compilation cache (trace + lower + cache read),
  (c) ``serialize_executable`` (jaxinfer's compile cache: deserialize only), (d) ``jax.export``
  (deserialize + compile, answered by the persistent cache; needs ``flatbuffers``).
* start: a fresh ``LLM`` process to its first token and to 32 tokens, cold (no compile cache)
  and warm (``--cache-dir`` from ``jaxinfer compile`` of the default bucket set), then the time
  to load the rest of the bucket set (warm) for comparison with compiling it.
* cli: the demo's `jaxinfer generate --chat` in a fresh process with JAX's persistent
  compilation cache off, cold and warm (``--xla-cache-dir``; jaxinfer/xla_cache.py).
* depth: seconds to compile the same buckets for models of 2 to 80 layers (abstract weights,
  bfloat16), scanned and, for SmolLM2, unrolled.

Every number goes to benchmarks/results/ through ``common.record`` and is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.common import record  # noqa: E402

PROGRAMS = [("sample", "decode", 1, 1, 16), ("sample", "decode", 8, 8, 128),
            ("sample", "prefill", 16, 1, 16), ("sample", "prefill", 512, 8, 128),
            ("logits", "prefill", 64, 1, 32), ("sample", "prefill", 128, 4, 64)]
DEPTH_MODELS = ["dummy:tiny-llama", "smollm2-135m", "dummy:llama-3.1-8b", "dummy:llama-3.1-70b"]
DEPTH_PROGRAMS = PROGRAMS[:4]


# ------------------------------------------------------------------ child processes
def _runner(model: str, **engine):
    from jaxinfer.compile import abstract_runner, model_config_of
    from jaxinfer.engine_config import engine_config_for

    mc = model_config_of(model)
    return abstract_runner(mc, engine_config_for(mc, engine)), mc


def _programs(spec):
    from jaxinfer.batch import Bucket
    from jaxinfer.compile_cache import Program

    return [Program(m, Bucket(k, t, s, p)) for m, k, t, s, p in spec]


def child_methods(a: dict) -> dict:
    """Load/compile PROGRAMS one way; per-program wall and CPU seconds."""
    import jax

    if a["method"] in ("persistent", "export", "fill-persistent", "fill-export"):
        jax.config.update("jax_compilation_cache_dir", a["pcache"])
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    runner, mc = _runner(a["model"], scan_layers=a["scan"])
    from jaxinfer.compile_cache import ProgramStore, fingerprint

    store = None
    if a["method"] == "serialized":
        ec = runner_ec(a["model"], a["scan"])
        store = ProgramStore.open(a["store"], fingerprint(mc, ec, runner), strict=True)
    wall, cpu = [], []
    for i, p in enumerate(_programs(PROGRAMS)):
        t0, c0 = time.perf_counter(), time.process_time()
        if a["method"] in ("compile", "persistent", "fill-persistent"):
            runner.lower(p.bucket, p.mode).compile()
        elif a["method"] == "serialized":
            assert store.load(p.mode, p.bucket) is not None
        elif a["method"] == "fill-export":
            from jax import export

            args = runner.abstract_args(p.bucket)
            leaves, tree = jax.tree.flatten(args)
            step = runner._jitted[p.mode]
            n_state = len(jax.tree.leaves(args[0]))
            n_cache = len(jax.tree.leaves(args[1]))

            def flat(*xs, step=step, tree=tree):
                return jax.tree.leaves(step(*jax.tree.unflatten(tree, xs)))

            donate = tuple(range(n_state, n_state + n_cache))
            exp = export.export(jax.jit(flat, donate_argnums=donate))(*leaves)
            blob = exp.serialize()
            Path(a["store"], f"exp{i}").write_bytes(blob)
            jax.jit(export.deserialize(blob).call).lower(*leaves).compile()  # fill pcache
        elif a["method"] == "export":
            from jax import export

            leaves = jax.tree.leaves(runner.abstract_args(p.bucket))
            exp = export.deserialize(bytearray(Path(a["store"], f"exp{i}").read_bytes()))
            jax.jit(exp.call).lower(*leaves).compile()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return {"wall": wall, "cpu": cpu}


def runner_ec(model: str, scan: bool | None):
    from jaxinfer.compile import model_config_of
    from jaxinfer.engine_config import engine_config_for

    return engine_config_for(model_config_of(model), {"scan_layers": scan})


def child_start(a: dict) -> dict:
    """Fresh process: LLM(...) to first token and to 32 tokens; warm: then load the rest."""
    t_import0 = time.time()
    from jaxinfer.llm import LLM
    from jaxinfer.sampling_params import SamplingParams

    t_import = time.time()
    kw = {"compile_cache_dir": a["cache"], "compile_cache_strict": True} if a["cache"] else {}
    llm = LLM(a["model"], **kw)
    t_engine = time.time()
    eng = llm.engine
    ids = eng.tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+2?"}])
    rid = eng.add_request(None, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
                          prompt_token_ids=ids)
    t_first, n = None, 0
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.request_id == rid and o.outputs[0].token_ids and t_first is None:
                t_first = time.time()
            n = len(o.outputs[0].token_ids)
    t_done = time.time()
    r = eng.runner
    out = {"t_import": t_import, "t_import0": t_import0, "t_engine": t_engine,
           "t_first": t_first, "t_done": t_done, "tokens": n, "prompt_tokens": len(ids),
           "compiled": r.num_compilations, "loaded": r.num_loaded}
    if a["cache"]:
        from jaxinfer.compile import preload

        t0 = time.time()
        out["programs_total"] = preload(eng)
        out["preload_rest_s"] = time.time() - t0
    return out


def child_depth(a: dict) -> dict:
    """Per-program compile seconds for one model (abstract bf16 weights)."""
    runner, mc = _runner(a["model"], dtype="bfloat16", scan_layers=a["scan"])
    secs = []
    for p in _programs(DEPTH_PROGRAMS[:a["n"]]):
        t0 = time.perf_counter()
        runner.lower(p.bucket, p.mode).compile()
        secs.append(time.perf_counter() - t0)
    return {"seconds": secs, "layers": mc.num_layers}


CHILDREN = {"methods": child_methods, "start": child_start, "depth": child_depth}


def run_child(kind: str, args: dict, env: dict | None = None) -> tuple[dict, float]:
    """Run one measurement in a fresh process; returns (its JSON, parent wall seconds)."""
    e = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT), **(env or {}))
    e.pop("JAX_COMPILATION_CACHE_DIR", None)
    t0 = time.time()
    p = subprocess.run([sys.executable, __file__, "--child", kind, json.dumps(args)],
                       capture_output=True, text=True, env=e, cwd=ROOT, check=False)
    if p.returncode:
        raise RuntimeError(f"{kind} {args} failed:\n{p.stderr[-3000:]}")
    out = json.loads(p.stdout.strip().splitlines()[-1])
    out["t_spawn"] = t0
    return out, time.time() - t0


# ------------------------------------------------------------------ parts
def part_methods(model: str, repeats: int, scan: bool | None) -> None:
    from jaxinfer.compile import compile_bucket_set, model_config_of

    tmp = Path(tempfile.mkdtemp(prefix="startup-methods-"))
    mc = model_config_of(model)
    compile_bucket_set(mc, runner_ec(model, scan), _programs(PROGRAMS), tmp / "store",
                       progress=False)
    base = {"model": model, "programs": len(PROGRAMS), "scan_layers": scan}
    methods = ["compile", "persistent", "serialized"]
    run_child("methods", {"model": model, "method": "fill-persistent", "scan": scan,
                          "pcache": str(tmp / "pcache")})
    try:
        import flatbuffers  # noqa: F401

        run_child("methods", {"model": model, "method": "fill-export", "store": str(tmp),
                              "scan": scan, "pcache": str(tmp / "pcache-export")})
        methods.append("export")
    except ImportError:
        print("jax.export skipped: flatbuffers is not installed")
    print(f"\nload {len(PROGRAMS)} {model} programs (scan_layers={scan}) in a fresh process "
          f"(s per program, median of {repeats})")
    for m in methods:
        args = {"model": model, "method": m, "scan": scan,
                "store": str(tmp / "store") if m == "serialized" else str(tmp),
                "pcache": str(tmp / ("pcache-export" if m == "export" else "pcache"))}
        runs = [run_child("methods", args)[0] for _ in range(repeats)]
        wall = statistics.median(statistics.mean(r["wall"]) for r in runs)
        cpu = statistics.median(statistics.mean(r["cpu"]) for r in runs)
        print(f"  {m:11} wall {wall:7.3f}  cpu {cpu:7.3f}")
        record("startup_program_load_wall", wall, "s/program", dict(base, method=m))
        record("startup_program_load_cpu", cpu, "s/program", dict(base, method=m))


def part_start(model: str, cache: str, repeats: int) -> None:
    print(f"\nfresh-process start, {model}, chat 'What is 2+2?', 32 greedy tokens "
          f"(median of {repeats})")
    for mode in ("cold", "warm"):
        runs = [run_child("start", {"model": model, "cache": cache if mode == "warm" else ""})[0]
                for _ in range(repeats)]

        def med(key: str, runs=runs) -> float:
            return statistics.median(r[key] for r in runs)

        ttft = statistics.median(r["t_first"] - r["t_spawn"] for r in runs)
        done = statistics.median(r["t_done"] - r["t_spawn"] for r in runs)
        eng = statistics.median(r["t_engine"] - r["t_import"] for r in runs)
        imp = statistics.median(r["t_import"] - r["t_spawn"] for r in runs)
        first = statistics.median(r["t_first"] - r["t_engine"] for r in runs)
        r0 = runs[0]
        print(f"  {mode}: first token {ttft:6.2f} s (python+imports {imp:.2f}, weights+engine "
              f"{eng:.2f}, prefill incl. programs {first:.2f}); 32 tokens {done:6.2f} s; "
              f"programs compiled {r0['compiled']}, loaded {r0['loaded']}")
        cfg = {"model": model, "mode": mode, "prompt_tokens": r0["prompt_tokens"],
               "compiled": r0["compiled"], "loaded": r0["loaded"]}
        record("startup_time_to_first_token", ttft, "s", cfg)
        record("startup_time_to_32_tokens", done, "s", cfg)
        record("startup_first_token_after_engine", first, "s", cfg)
        if mode == "warm":
            print(f"  warm: loading all {r0['programs_total']} programs took "
                  f"{med('preload_rest_s'):.2f} s")
            record("startup_load_all_programs", med("preload_rest_s"), "s",
                   dict(cfg, programs=r0["programs_total"]))
    manifest = json.loads(Path(cache, "manifest.json").read_text())
    total = sum(p["compile_seconds"] for p in manifest["programs"])
    print(f"  cold: compiling all {len(manifest['programs'])} programs took {total:.1f} s "
          f"(jaxinfer compile, {cache}/manifest.json)")
    record("startup_compile_all_programs", total, "s",
           {"model": model, "programs": len(manifest["programs"]), "source": "manifest"})


def part_cli(model: str, repeats: int) -> None:
    """The demo's command (`jaxinfer generate --chat "What is 2+2?"`) in fresh processes:
    JAX's persistent compilation cache off, then cold (an empty cache) and warm (what the
    cold run wrote; jaxinfer/xla_cache.py)."""
    import re

    xla = Path(tempfile.mkdtemp(prefix="startup-xla-"))
    print(f"\n`jaxinfer generate --chat` on {model}, fresh processes (median of {repeats}; "
          f"cold: once)")
    for mode in ("off", "cold", "warm"):
        runs = []
        for _ in range(1 if mode == "cold" else repeats):
            t0 = time.perf_counter()
            out = subprocess.run(
                [sys.executable, "-m", "jaxinfer.cli", "generate", "--model", model, "--chat",
                 "--xla-cache-dir", "off" if mode == "off" else str(xla), "What is 2+2?"],
                capture_output=True, text=True, check=True,
                env={**os.environ, "PYTHONPATH": str(ROOT)})
            wall = time.perf_counter() - t0
            m = re.search(r"after ([\d.]+) s loading and ([\d.]+) s building (\d+) compiled "
                          r"\+ (\d+) cached", out.stderr)
            if not m:
                raise SystemExit(f"no summary line in: {out.stderr[-2000:]}")
            runs.append((wall, float(m[1]), float(m[2]), int(m[3]), int(m[4])))
        wall, load, build = (statistics.median(r[i] for r in runs) for i in range(3))
        compiled, cached = runs[-1][3:]
        print(f"  {mode:5}: process {wall:6.2f} s (loading {load:.2f}, building {build:.2f}: "
              f"{compiled} compiled + {cached} cached)")
        cfg = {"model": model, "xla_cache": mode, "command": "jaxinfer generate --chat",
               "compiled": compiled, "cached": cached, "runs": len(runs),
               "loading_s": load}
        record("startup_cli_generate_wall", wall, "s", cfg)
        record("startup_cli_generate_build", build, "s", cfg)


def part_depth(n_programs: int) -> None:
    print(f"\ncompile seconds per program, bfloat16, abstract weights; buckets "
          f"{DEPTH_PROGRAMS[:n_programs]}")
    variants = [(m, True) for m in DEPTH_MODELS] + [
        (m, False) for m in ("dummy:tiny-llama", "smollm2-135m", "dummy:llama-3.1-70b")]
    for model, scan in variants:
        r, _ = run_child("depth", {"model": model, "scan": scan, "n": n_programs})
        secs = r["seconds"]
        print(f"  {model:22} {r['layers']:3} layers {'scanned' if scan else 'unrolled':8} "
              + "  ".join(f"{s:6.2f}" for s in secs) + f"   mean {statistics.mean(secs):6.2f}")
        for spec, s in zip(DEPTH_PROGRAMS, secs):
            record("compile_seconds_per_program", s, "s",
                   {"model": model, "layers": r["layers"], "scan_layers": scan,
                    "dtype": "bfloat16", "program": list(spec)})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--parts", default="methods,start,depth")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--cache-dir", default=str(ROOT / ".cache" / "compile" / "smollm2"),
                    help="compile cache of the default bucket set (jaxinfer compile)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--depth-programs", type=int, default=2)
    ap.add_argument("--scan-layers", choices=["auto", "true", "false"], default="auto",
                    help="methods part: the engine default (auto: unrolled on CPU) or forced")
    ns = ap.parse_args()
    if ns.child:
        import warnings

        warnings.simplefilter("ignore")
        print(json.dumps(CHILDREN[ns.child[0]](json.loads(ns.child[1]))))
        return
    parts = ns.parts.split(",")
    if "methods" in parts:
        scan = {"auto": None, "true": True, "false": False}[ns.scan_layers]
        part_methods(ns.model, ns.repeats, scan)
    if "start" in parts:
        part_start(ns.model, ns.cache_dir, ns.repeats)
    if "cli" in parts:
        part_cli(ns.model, ns.repeats)
    if "depth" in parts:
        part_depth(ns.depth_programs)


if __name__ == "__main__":
    main()
