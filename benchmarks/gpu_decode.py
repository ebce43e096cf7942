"""GPU end-to-end decode benchmark (Llama-3.1-8B shape, random bf16 weights) + checks.

Run on the GPU machine (one call):
    PYTHONPATH=. python3 benchmarks/gpu_decode.py --out $OUT [--peer .peers/torch_compile_llama.py]

1. Ceilings measured in this run: device copy bandwidth, bf16 matmul rate
   (``jaxinfer.bench.roofline.measure_ceilings``).
2. Correctness: a tiny random model (bf16) gives the same greedy tokens with the Pallas
   attention backend as with the jnp reference backend.
3. The PyTorch peer (torch.compile + CUDA graphs), as a subprocess before us, same shape.
4. jaxinfer: LLMEngine on dummy:llama-3.1-8b, prompts of --ctx tokens, --steps greedy tokens
   (EOS ignored); decode step time (TPOT) per batch size, end to end through the engine
   (scheduler, host arrays, sampled tokens back every step) and device-only (the compiled
   decode program replayed), for each attention backend.
Prints a short table last; writes JSON records under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import apply_patches  # noqa: E402  (after the repo root is on the path)


def median_time(fn, n: int = 10, warm: int = 2) -> float:
    import jax

    for _ in range(warm):
        jax.block_until_ready(fn())
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def pipelined_time(fn, n: int = 30) -> float:
    """Seconds per call of fn issued n times back to back, one sync at the end: the step time
    when the host enqueues the next step while the device runs this one (no per-step sync)."""
    import jax

    jax.block_until_ready(fn())
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(n):
            r = fn()
        jax.block_until_ready(r)
        best = min(best, (time.perf_counter() - t0) / n)
    return best


def ceilings() -> dict:
    """Copy bandwidth and bf16 matmul rate, chained inside one program (jaxinfer.bench's
    roofline ceilings: no dispatch gap per call)."""
    from jaxinfer.bench.roofline import measure_ceilings

    c = measure_ceilings("bfloat16")
    return {"copy_GBps": c["copy_bytes_per_s"] / 1e9,
            "bf16_matmul_TFLOPs": c["matmul_flops_per_s"] / 1e12}


def check_tiny() -> dict:
    from jaxinfer import LLM, SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 250, n).tolist() for n in (1, 15, 16, 17, 40)]
    res = {"prompts": len(prompts)}
    # float32: the kernel must reproduce the reference's greedy tokens exactly; bf16: the
    # two paths round differently, so a random tiny model may flip a near-tie (reported).
    for dtype in ("float32", "bfloat16"):
        out = {}
        for backend in ("reference", "pallas"):
            llm = LLM("dummy:tiny-llama", dtype=dtype, attention_backend=backend,
                      max_model_len=128, max_num_seqs=8, num_kv_pages=64)
            out[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
        res[f"identical_{dtype}"] = sum(a == b for a, b in zip(out["reference"], out["pallas"]))
    return res


def run_peer(path: str, batches: list[int], ctx: int, steps: int, out: Path) -> list[dict]:
    peer_batches = [b for b in batches if b <= 1]  # the peer runs batch 1 only
    if not path or not Path(path).exists() or not peer_batches:
        return []
    j = out / "peer.json"
    cmd = [sys.executable, path, "--batch", *map(str, peer_batches),
           "--ctx", str(ctx),
           "--steps", str(steps), "--json", str(j)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    print(r.stdout[-2000:], r.stderr[-2000:] if r.returncode else "", flush=True)
    return json.loads(j.read_text()) if j.exists() else []


def decode_inputs(eng, b: int, ctx: int, distinct: bool = False):
    """Fixed inputs of eng's decode program for batch b at context ctx: (bucket, token ids,
    AttentionMetadata, greedy SamplingArrays). Every row at position ctx, pages 1.. in order;
    with ``distinct`` each row reads its own pages, so the KV bytes are the batch's, not one
    sequence's out of L2. The bucket is the widest page bucket of b rows."""
    import jax

    from jaxinfer.batch import Bucket, SamplingArrays

    bucket = Bucket("decode", b, b, eng.config.page_buckets[-1])
    bt = np.zeros((b, bucket.max_pages), np.int32)
    n = (ctx + 1) // 16 + 1
    bt[:, :n] = np.arange(1, n + 1)
    if distinct:
        bt[:, :n] += n * np.arange(b)[:, None]
    md = eng.runner.abstract_args(bucket)[3]
    md_arr = type(md)(positions=jax.numpy.full((b,), ctx, "int32"),
                      slot_mapping=jax.numpy.full((b,), 16 + ctx % 16, "int32"),
                      seq_ids=jax.numpy.arange(b, dtype="int32"),
                      block_tables=jax.numpy.asarray(bt),
                      seq_lens=jax.numpy.full((b,), ctx + 1, "int32"),
                      logits_indices=jax.numpy.arange(b, dtype="int32"), is_prefill=False)
    toks = jax.numpy.zeros((b,), "int32")
    sp = SamplingArrays(*map(jax.numpy.asarray, SamplingArrays.neutral(b)))  # greedy rows
    return bucket, toks, md_arr, sp


def decode_replay(eng, b: int, ctx: int, distinct: bool = False, exe=None):
    """A callable that replays eng's compiled decode program (or ``exe``, the same program
    compiled otherwise) for batch b at context ctx with ``decode_inputs``' fixed inputs, no
    host work: the device time of one decode step, the model program then the greedy sampler
    program (runner.py). The KV cache and the penalty counts are threaded through as the
    engine does (donated).
    """
    runner = eng.runner
    bucket, toks, md_arr, sp = decode_inputs(eng, b, ctx, distinct)
    exe = exe or runner.executable(bucket)

    def replay():  # runner.cache and runner.counts are donated: the runner threads them
        logits, runner.cache = exe(runner.weights, runner.cache, toks, md_arr)
        return runner.sample(logits, sp, "greedy")

    return replay


def add_step_shape_args(ap) -> None:
    """--model / --backend / --batch / --ctx of the scripts that time one engine's decode
    program at one shape (decode_launch.py, multistep_decode.py)."""
    ap.add_argument("--model", default="dummy:llama-3.1-8b")
    ap.add_argument("--backend", default="pallas:fp8", help="attention[:quantization]")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--ctx", type=int, default=512)


def make_engine(model, backend: str, batches: list[int], ctx: int, steps: int,
                scan_layers: bool | None = None, **engine_args):
    """An LLMEngine for decode timing: backend "attention[:quantization[:kv_cache_dtype]]"
    [+ "/ms<k>"], e.g. "pallas:fp8" (FP8 weights), "pallas::fp8" (bf16 weights, FP8 KV
    cache), "pallas:fp8:fp8/ms8" (and 8 decode steps a program: num_scheduler_steps)."""
    from jaxinfer.engine import LLMEngine

    backend, _, multi = backend.partition("/ms")
    if multi:
        engine_args = {"num_scheduler_steps": int(multi), **engine_args}
    backend, _, rest = backend.partition(":")
    quant, _, kv = rest.partition(":")
    args = dict(dtype="bfloat16", attention_backend=backend, quantization=quant or None,
                kv_cache_dtype=kv or "auto",
                scan_layers=scan_layers, max_model_len=ctx + steps + max(batches) + 16,
                max_num_seqs=max(batches), decode_buckets=tuple(batches),
                max_num_batched_tokens=ctx, prefill_buckets=(ctx,), max_prefill_seqs=1)
    return LLMEngine(model, **{**args, **engine_args})


def engine_decode(model, backend: str, batches: list[int], ctx: int, steps: int,
                  deadline: float, scan_layers: bool | None = None) -> dict:
    import jax

    from jaxinfer import SamplingParams

    t0 = time.perf_counter()
    eng = make_engine(model, backend, batches, ctx, steps, scan_layers)
    res = {"load_s": time.perf_counter() - t0}
    rng = np.random.default_rng(0)
    for b in batches:
        # one prefill a step: the b-th request starts decoding b steps after the first, so
        # each runs steps + b tokens and the last `steps` steps have all b in the batch
        sp = SamplingParams(temperature=0.0, max_tokens=steps + b, ignore_eos=True)
        if time.perf_counter() > deadline:
            res[f"b{b}"] = "skipped (time guard)"
            continue
        # warm-up: the same shape first, so that no timed step compiles (a multi-step
        # program is built at its first window: num_scheduler_steps)
        k = eng.config.num_scheduler_steps
        warm = SamplingParams(temperature=0.0, max_tokens=b + 2 * k + 2, ignore_eos=True)
        for s in (warm, sp):
            for _ in range(b):
                eng.add_request(rng.integers(0, eng.model_config.vocab_size, ctx).tolist(), s)
            if s is warm:
                while eng.has_unfinished_requests():
                    eng.step()
        windows, piped = eng.num_multi_steps, eng.num_pipelined_windows
        times, tc, tokens, seen = [], time.perf_counter(), {}, {}
        while eng.has_unfinished_requests():
            ts = time.perf_counter()
            outs = eng.step()
            dt = time.perf_counter() - ts
            if outs and all(len(o.outputs[0].token_ids) > 2 for o in outs) and len(outs) == b:
                # a multi-step window returns k tokens a request: time per token
                new = min(len(o.outputs[0].token_ids) - seen.get(o.request_id, 0)
                          for o in outs)
                times += [dt / max(new, 1)] * max(new, 1)
            seen.update((o.request_id, len(o.outputs[0].token_ids)) for o in outs)
            tokens.update((o.request_id, list(o.outputs[0].token_ids)) for o in outs
                          if o.finished)
        replay = decode_replay(eng, b, ctx)
        dev = median_time(replay, n=20)
        res[f"b{b}"] = {"tpot_ms_engine": 1000 * float(np.median(times)),
                        "tpot_ms_engine_mean": 1000 * float(np.mean(times)),
                        "multi_step_windows": eng.num_multi_steps - windows,
                        "pipelined_windows": eng.num_pipelined_windows - piped,
                        "tpot_ms_device": 1000 * dev,
                        "tpot_ms_pipelined": 1000 * pipelined_time(replay),
                        "steps": len(times), "wall_s": time.perf_counter() - tc,
                        # greedy tokens of the first requests: A/Bs across processes compare
                        "tokens": [tokens[k] for k in sorted(tokens)[:4]]}
    res["compilations"] = eng.runner.num_compilations
    res["compile_s"] = {str(k[1]): round(v, 2) for k, v in eng.runner.compile_seconds.items()}
    res["weight_bytes"] = int(sum(x.size * x.dtype.itemsize
                                  for x in jax.tree.leaves(eng.runner.state)))
    del eng
    import gc

    gc.collect()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/gpu")
    ap.add_argument("--model", default="dummy:llama-3.1-8b")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--peer", default=".peers/torch_compile_llama.py",
                    help="the PyTorch peer script, run at batch 1 first (\"\" skips it)")
    ap.add_argument("--backends", nargs="+", default=["pallas", "reference", "pallas:fp8"],
                    help="attention backend[:quantization[:kv_cache_dtype]] variants, run in "
                         "this order (e.g. pallas:fp8, pallas::fp8 for an FP8 KV cache)")
    ap.add_argument("--budget-s", type=float, default=480)
    ap.add_argument("--quick", action="store_true", help="skip the ceilings and tiny check")
    ap.add_argument("--scan-layers", choices=["auto", "true", "false"], default="auto")
    ap.add_argument("--patch", action="append", default=[], metavar="MODULE.NAME=VALUE",
                    help="set a module constant before any engine is built (an A/B of a "
                         "plan constant with no environment switch), e.g. pallas_kernels."
                         "matmul.fp8_plan.FP8_GATE_UP_EPILOGUE_MAX_M=32; VALUE is a Python "
                         "literal; recorded in the summary")
    ns = ap.parse_args()
    patches = apply_patches(ns.patch, "gpu_decode")
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.perf_counter() + ns.budget_s
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.85")

    peer = run_peer(ns.peer, ns.batches, ns.ctx, ns.steps, out)
    import jax

    summary = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
               "peer": peer, "patches": patches, "model": ns.model, "ctx": ns.ctx,
               "steps": ns.steps}
    summary["ceilings"] = {"copy_GBps": 4300.0} if ns.quick else ceilings()
    print("ceilings", summary["ceilings"], flush=True)
    try:
        summary["tiny_check"] = "skipped" if ns.quick else check_tiny()
    except Exception as e:  # noqa: BLE001 - report and go on to the timings
        traceback.print_exc()
        summary["tiny_check"] = f"failed: {e!r}"
    print("tiny check", summary["tiny_check"], flush=True)
    from jaxinfer.loading import load_model

    t0 = time.perf_counter()
    # once for all variants; FP8 projections made as FP8 directly when every variant is FP8
    # (a 70B dummy in bf16 would need 140 GB of host memory)
    quant = "fp8" if all(b.split(":")[1:2] == ["fp8"] for b in ns.backends) else None
    model = load_model(ns.model, dtype="bfloat16", quantization=quant, progress=False)
    summary["dummy_build_s"] = time.perf_counter() - t0
    scan = {"auto": None, "true": True, "false": False}[ns.scan_layers]
    for i, backend in enumerate(ns.backends):
        if time.perf_counter() > deadline:
            break
        batches = ns.batches if i == 0 else [b for b in ns.batches if b <= 16]
        try:
            summary[backend] = engine_decode(model, backend, batches, ns.ctx, ns.steps,
                                             deadline, scan_layers=scan)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            summary[backend] = {"error": repr(e)}
            if backend.startswith("pallas") and not backend.startswith("pallas_decode"):
                # The prefill kernel is the newest part: retry with the decode kernel only.
                alt = backend.replace("pallas", "pallas_decode", 1)
                try:
                    summary[alt] = engine_decode(model, alt, batches, ns.ctx, ns.steps,
                                                 deadline)
                except Exception as e2:  # noqa: BLE001
                    traceback.print_exc()
                    summary[alt] = {"error": repr(e2)}
                print(alt, json.dumps(summary[alt]), flush=True)
        print(backend, json.dumps(summary[backend]), flush=True)
        (out / "gpu_decode_summary.json").write_text(json.dumps(summary, indent=1))
    (out / "gpu_decode_summary.json").write_text(json.dumps(summary, indent=1))

    bw = summary["ceilings"]["copy_GBps"] * 1e9
    peer_ms = {r["config"]["batch"]: r["value"] for r in peer}
    print(f"\n{'backend':>10} {'B':>3} {'TPOT eng ms':>12} {'TPOT dev ms':>12} {'pipelined':>9} "
          f"{'weights TB/s':>12} {'% copy bw':>9} {'peer ms':>8} {'ours/peer':>9}")
    for backend in [k for k in summary if k.startswith(("pallas", "reference"))]:
        r = summary.get(backend, {})
        for b in ns.batches:
            x = r.get(f"b{b}")
            if not isinstance(x, dict):
                continue
            tb = r["weight_bytes"] / (x["tpot_ms_device"] / 1000)
            p = peer_ms.get(b)
            print(f"{backend:>10} {b:>3} {x['tpot_ms_engine']:>12.2f} {x['tpot_ms_device']:>12.2f}"
                  f" {x.get('tpot_ms_pipelined', float('nan')):>9.2f}"
                  f" {tb / 1e12:>12.2f} {100 * tb / bw:>9.1f} {p or float('nan'):>8.2f}"
                  f" {x['tpot_ms_engine'] / p if p else float('nan'):>9.2f}")


if __name__ == "__main__":
    main()
