"""Host and launch cost of one decode step, per XLA command-buffer setting (GPU).

The engine's decode step is one XLA program (the model) then one small sampler program. At
batch 1 on an H200 the 8B FP8 model program takes 3.25 ms back to back but 4.67 ms when each
call is waited for (session 10, NOTES_matmul "Session 10"): launch and host time the async
engine does not hide. This script compiles the same decode program of one engine several
times, each with its own ``compiler_options`` (XLA's command buffers — CUDA graphs — on,
off, with ``WHILE`` / ``CONDITIONAL`` added, with the minimum graph size at 1), and for each
replays it with fixed inputs (``gpu_decode.decode_inputs``) and reports:

  dispatch_ms   host time until the model call returns (enqueue only, median),
  sample_ms     host time until the sampler call returns,
  sync_ms       one step, dispatched and waited for (median),
  b2b_ms        steps issued back to back, one wait at the end (per step, best of 3),
  hlo           kernels of the optimized program: fusions, custom calls, while / conditional.

Also the host cost of the weights' argument form: ``jax.tree.flatten`` of the nnx.State and a
compiled no-op called with it and with the flat list the runner passes (a compiled call
flattens its arguments every step).

  PYTHONPATH=. python3 benchmarks/decode_launch.py --backend pallas:fp8 --batch 1 \\
      --out $OUT/launch
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

# XLA's command types (xla.proto DebugOptions.CommandBufferCmdType); compiler_options take a
# full list (the "+WHILE" form is XLA_FLAGS syntax only).
_ALL = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL"
_X = "xla_gpu_experimental_"
VARIANTS = {  # name -> compiler_options added to the runner's COMPILER_OPTIONS
    "default": {},
    "cb_off": {"xla_gpu_enable_command_buffer": ""},
    "min1": {"xla_gpu_graph_min_graph_size": 1},
    "while_cond": {"xla_gpu_enable_command_buffer": _ALL},
    "while_cond_min1": {"xla_gpu_enable_command_buffer": _ALL, "xla_gpu_graph_min_graph_size": 1},
    # how the graph's nodes are ordered: XLA's default LHS (edges from the latency-hiding
    # schedule), SERIALIZE (one after another: a straight-line graph), CONCURRENT (data edges)
    "serialize": {"xla_gpu_command_buffer_scheduling_mode": "SERIALIZE"},
    "concurrent": {"xla_gpu_command_buffer_scheduling_mode": "CONCURRENT"},
    # fewer kernels (graph nodes): XLA's experimental Triton fusions, which can fuse a
    # reduction with its consumers (RMSNorm, the FP8 per-token absmax -> quantize); the names
    # are the options this jaxlib accepts (others fail with "No such compile option")
    "heroless": {_X + "enable_triton_heroless_priority_fusion": True},
    "block_level": {_X + "enable_fusion_block_level_rewriter": True},
    "block_heroless": {_X + "enable_fusion_block_level_rewriter": True,
                       _X + "enable_triton_heroless_priority_fusion": True},
    "all_triton": {_X + "all_fusions_with_triton": True},
    "multi_output": {"xla_gpu_unsupported_enable_triton_multi_output_fusion": True,
                     _X + "enable_same_shape_multi_output_fusion": True},
    # programmatic dependent launch (Hopper+): XLA puts griddepcontrol.wait at the start of
    # the kernels it generates and launches them early (openxla/xla#38544); ``_launch`` also
    # lets Triton GEMMs trigger their successor before the epilogue (openxla/xla#43894). Both
    # are on by default in jaxlib 0.11.2 (its dumped debug_options diff), so "pdl_off" is the
    # variant that differs (H200, session 16: 1.6 % slower back to back)
    "pdl_off": {"xla_gpu_enable_pdl": False, "xla_gpu_enable_pdl_launch": False},
    "pdl": {"xla_gpu_enable_pdl": True, "xla_gpu_enable_pdl_launch": False},
    "pdl_launch": {"xla_gpu_enable_pdl": True, "xla_gpu_enable_pdl_launch": True},
    # which graph nodes are re-written before a replay: every node whose buffers moved
    # (ALWAYS_UPDATE), not those on the temp buffer, held at one virtual address
    # (SKIP_TEMP, openxla/xla#45062), or also parameters / outputs whose addresses held
    # over the first 3 runs (SKIP_PROFILED, openxla/xla#45597)
    "upd_always": {"xla_gpu_command_buffer_update_mode": "ALWAYS_UPDATE"},
    "upd_skip_temp": {"xla_gpu_command_buffer_update_mode": "SKIP_TEMP"},
    "upd_skip_profiled": {"xla_gpu_command_buffer_update_mode": "SKIP_PROFILED"},
    "pdl_skip_temp": {"xla_gpu_enable_pdl": True, "xla_gpu_enable_pdl_launch": True,
                      "xla_gpu_command_buffer_update_mode": "SKIP_TEMP"},
}


def hlo_counts(text: str) -> dict:
    """Kernel-launching instructions of an optimized HLO module's text (entry and callees)."""
    ops = re.findall(r"=\s*[^=]*?\s(fusion|custom-call|while|conditional|copy-start|"
                     r"dynamic-update-slice|call)\(", text)
    out = {k: ops.count(k) for k in sorted(set(ops))}
    out["custom_call_targets"] = sorted(set(re.findall(r'custom_call_target="([^"]+)"', text)))
    return out


def host_times(fn, n: int) -> list[float]:
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return ts


def host_trace(step, n: int) -> list[tuple[str, float, float]]:
    """(event name, us per step, calls per step) of the host (non-device) threads' trace
    events over n waited steps, by total time; events nest, so the totals overlap."""
    import collections
    import tempfile

    import jax
    from profile_decode import load_trace

    d = tempfile.mkdtemp(prefix="launch_trace_")
    jax.block_until_ready(step())
    with jax.profiler.trace(d, create_perfetto_trace=True):
        for _ in range(n):
            jax.block_until_ready(step())
    events = load_trace(d)
    dev = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
           and str(e.get("args", {}).get("name", "")).startswith("/device:")}
    per, cnt = collections.Counter(), collections.Counter()
    for e in events:
        if e.get("ph") == "X" and e.get("pid") not in dev and e.get("dur"):
            per[e["name"]] += e["dur"]
            cnt[e["name"]] += 1
    return sorted(((k, v / n, cnt[k] / n) for k, v in per.items()), key=lambda r: -r[1])


def main() -> None:
    from gpu_decode import add_step_shape_args

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_step_shape_args(ap)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--scan-layers", action="store_true",
                    help="the layers under lax.scan (one loop body instead of L unrolled layers)")
    ap.add_argument("--dump-hlo", action="store_true",
                    help="write each variant's optimized HLO text (gzip) next to the record")
    ap.add_argument("--num-kv-pages", type=int, default=0,
                    help="KV pool pages (default: sized to the free memory; the scanned "
                         "model's one stacked pool can fail to allocate there)")
    ap.add_argument("--num-layers", type=int, default=0,
                    help="override the dummy model's depth (a host-cost study on the CPU)")
    ap.add_argument("--out", default="benchmarks/results/launch")
    ap.add_argument("--host-trace", type=int, default=0, metavar="N",
                    help="trace N waited steps of the last variant that compiled and sum the "
                         "host-side "
                         "events by name (set XLA_FLAGS=--xla_enable_command_buffers_during_"
                         "profiling=true to keep the command buffers under the profiler)")
    ns = ap.parse_args()

    import jax
    from gpu_decode import decode_inputs, decode_replay, make_engine, median_time, pipelined_time

    from jaxinfer.runner import COMPILER_OPTIONS

    if ns.num_layers:
        import dataclasses

        from jaxinfer.loading.dummy import DUMMY_CONFIGS

        shape = ns.model.removeprefix("dummy:")
        DUMMY_CONFIGS[shape] = dataclasses.replace(DUMMY_CONFIGS[shape], num_layers=ns.num_layers,
                                                   layer_types=None)
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    eng = make_engine(ns.model, ns.backend, [ns.batch], ns.ctx, 32,
                      scan_layers=True if ns.scan_layers else None,
                      **({"num_kv_pages": ns.num_kv_pages} if ns.num_kv_pages else {}))
    runner = eng.runner
    bucket, toks, md_arr, sp = decode_inputs(eng, ns.batch, ns.ctx)
    exe0 = runner.executable(bucket)  # also builds the sampler programs
    load_s = time.perf_counter() - t0
    leaves = runner.weights
    flat_us = 1e6 * float(np.median(host_times(lambda: jax.tree.flatten(runner.state), 50)))
    # The host cost of the argument form alone: a compiled no-op called with the weights as
    # the nnx.State the runner used to pass and as the flat list it passes now.
    call_us = {}
    for form, arg in (("nnx_state", runner.state), ("flat_list", runner.weights)):
        noop = jax.jit(lambda w: 0).lower(arg).compile()
        noop(arg)
        call_us[form] = 1e6 * float(np.median(host_times(lambda: noop(arg), 50)))
    print(f"engine + first compile {load_s:.1f} s; {len(leaves)} weight arrays, "
          f"tree.flatten {flat_us:.0f} us, no-op call {call_us}", flush=True)
    rec = {"model": ns.model, "backend": ns.backend, "batch": ns.batch, "ctx": ns.ctx,
           "scan_layers": ns.scan_layers,
           "bucket": str(bucket), "weight_leaves": len(leaves), "flatten_us": flat_us,
           "noop_call_us": call_us,
           "load_s": load_s, "device": jax.devices()[0].device_kind, "jax": jax.__version__,
           "variants": {}}
    names = ns.variants.split(",")
    if names[0] != "default":
        raise SystemExit("--variants must start with default (the logits reference)")
    ref = traced = None
    for name in names:
        opts = {**COMPILER_OPTIONS, **VARIANTS[name]}
        t1 = time.perf_counter()
        try:
            exe = exe0 if name == "default" else runner.lower(bucket).compile(
                compiler_options=opts)
        except Exception as e:  # noqa: BLE001 - record and go on
            rec["variants"][name] = {"error": repr(e)[:400]}
            print(name, "compile failed:", repr(e)[:300], flush=True)
            continue
        compile_s = time.perf_counter() - t1

        step = decode_replay(eng, ns.batch, ns.ctx, exe=exe)
        traced = (name, step)  # --host-trace follows the last variant that compiled
        logits, runner.cache = exe(runner.weights, runner.cache, toks, md_arr)
        logits = np.asarray(logits, np.float64)
        ref = logits if ref is None else ref
        jax.block_until_ready(step())
        disp, samp = [], []
        for _ in range(ns.steps):
            jax.block_until_ready(runner.cache)
            ta = time.perf_counter()
            logits, runner.cache = exe(runner.weights, runner.cache, toks, md_arr)
            tb = time.perf_counter()
            r = runner.sample(logits, sp, "greedy")
            tc = time.perf_counter()
            jax.block_until_ready(r)
            disp.append(tb - ta)
            samp.append(tc - tb)
        v = {"options": VARIANTS[name], "compile_s": compile_s,
             "dispatch_ms": 1e3 * float(np.median(disp)),
             "sample_ms": 1e3 * float(np.median(samp)),
             "sync_ms": 1e3 * median_time(step, n=ns.steps),
             "b2b_ms": 1e3 * pipelined_time(step, n=ns.steps),
             "hlo": hlo_counts(exe.as_text() or ""),
             # the same inputs through the default program: are the logits the same math?
             "logits_rel_err": float(np.linalg.norm(logits - ref) / np.linalg.norm(ref)),
             "argmax_equal": bool((logits.argmax(-1) == ref.argmax(-1)).all())}
        if ns.dump_hlo:
            import gzip

            with gzip.open(out / f"hlo_{name}.txt.gz", "wt") as f:
                f.write(exe.as_text() or "")
        rec["variants"][name] = v
        print(name, json.dumps({k: (round(x, 3) if isinstance(x, float) else x)
                                for k, x in v.items() if k != "hlo"}), flush=True)
        (out / "decode_launch.json").write_text(json.dumps(rec, indent=1))
    if ns.host_trace and traced:
        rec["host_trace_variant"] = traced[0]
        rec["host_trace"] = host_trace(traced[1], ns.host_trace)
        (out / "decode_launch.json").write_text(json.dumps(rec, indent=1))
    print(f"\n{ns.backend} B{ns.batch} ctx{ns.ctx}: {'variant':>16} {'dispatch':>9} "
          f"{'sample':>7} {'sync':>7} {'b2b':>7} ms {'kernels':>8} {'rel.err':>8}")
    for name, v in rec["variants"].items():
        if "error" in v:
            print(f"{name:>16} error")
            continue
        nk = sum(n for k, n in v["hlo"].items() if k in ("fusion", "custom-call",
                                                             "dynamic-update-slice"))
        print(f"{name:>16} {v['dispatch_ms']:9.3f} {v['sample_ms']:7.3f} {v['sync_ms']:7.3f} "
              f"{v['b2b_ms']:7.3f}    {nk:8d} {v['logits_rel_err']:8.1e}"
              f"{'' if v['argmax_equal'] else ' ARGMAX DIFFERS'}")
    print("hlo (default):", json.dumps(rec["variants"].get("default", {}).get("hlo")))
    if "host_trace" in rec:
        print(f"host events of {rec['host_trace_variant']}, us per step "
              f"(top 30 of {len(rec['host_trace'])}):")
        for name, us, calls in rec["host_trace"][:30]:
            print(f"  {us:9.1f} {calls:7.1f}  {name[:110]}")


if __name__ == "__main__":
    main()
