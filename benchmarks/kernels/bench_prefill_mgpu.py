"""Hopper prefill attention candidates vs our Triton paged kernel, in one GPU run (< 200 s).

Candidates, each checked against ``paged_prefill_attention_ref`` (rel L2 < 2e-2, fresh random
inputs) before it is timed, at Hq 32 / Hkv 8 / D 128 / page 16:
- ``ours``: pallas_kernels.paged_attention.paged_prefill_attention (Triton lowering).
- ``mgpu_varlen[bq,bkv,mcs]``: prefill_mgpu.paged_prefill_attention_mgpu (pages gathered to
  a packed buffer + varlen FA3 Mosaic kernel); ``..._kernel``: the kernel alone on a plan
  made beforehand.
- ``stock_mgpu[bq,bkv,mcs]``: JAX's attention_mgpu (FA3, Mosaic GPU) on contiguous f16 K/V
  (its shared memory is declared f16), ``_gather``: with the page gather, q scaling and the
  casts in the timed step. Equal-length fresh sequences only.
- ``cudnn_gather``: jax.nn.dot_product_attention(implementation="cudnn") after the gather.
- the XLA bf16 matmul rate (8192^3) in the same process, for the ratio.
Mosaic candidates run in a worker subprocess (a faulting kernel can poison the CUDA
context); a worker that dies is restarted on the remaining candidates.

    PYTHONPATH=. timeout 200 python3 -u benchmarks/kernels/bench_prefill_mgpu.py --out $OUT/prefill_mgpu
    PYTHONPATH=. python benchmarks/kernels/bench_prefill_mgpu.py --list     # on CPU: the plan
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # parent + worker share a GPU

import argparse  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks.kernels.bench_paged_prefill import make_case  # noqa: E402
from benchmarks.kernels.kernel_bench import RunRecords, rel_err, time_fn  # noqa: E402
from pallas_kernels.paged_attention import (  # noqa: E402
    paged_prefill_attention,
    paged_prefill_attention_ref,
)

T0 = time.time()
SHAPES = {"1x4096": [(0, 4096)], "2x2048": [(0, 2048)] * 2, "8x512": [(0, 512)] * 8,
          "chunked_1024+512": [(1024, 512)]}
CALLS = 4


def log(*a) -> None:
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def mgpu_candidates(shapes: list[str]) -> list[dict]:
    """Mosaic candidates in priority order (the run stops at its deadline)."""
    out = []
    vl = [(64, 128, 2), (64, 64, 4), (64, 64, 2), (64, 128, 3), (128, 64, 2)]
    st = [(64, 128, 2), (64, 64, 4), (64, 64, 2), (128, 64, 2), (64, 128, 4), (128, 128, 2),
          (128, 64, 4), (128, 128, 4)]
    for shape in shapes:  # defaults first at every shape, then the grids at 1x4096
        out.append({"impl": "mgpu_varlen", "shape": shape, "tune": vl[0]})
        if shape != "chunked_1024+512":
            out.append({"impl": "stock_mgpu", "shape": shape, "tune": st[0]})
    out += [{"impl": "mgpu_varlen", "shape": "1x4096", "tune": t} for t in vl[1:]]
    out += [{"impl": "stock_mgpu", "shape": "1x4096", "tune": t} for t in st[1:]]
    return out


def gather_dense(c: dict, layer) -> tuple[jax.Array, jax.Array]:
    """Pages of equal-length sequences -> contiguous k, v [B, n, Hkv, D]."""
    B, n = len(c["seqs"]), c["seqs"][0][1]
    ps = c["ps"]
    tok = jnp.arange(n)
    page = c["bt"][:, tok // ps]  # [B, n]

    def g(cache):
        return cache[layer][:, page, tok % ps].transpose(1, 2, 0, 3)  # [B, n, Hkv, D]
    return g(c["kc"]), g(c["vc"])


def paged_step(c: dict, impl: str, tune: tuple | None):
    """f(q, layer) -> out [T, Hq, D] for the paged candidates, plus the jit of the chain."""
    from pallas_kernels.paged_attention import prefill_mgpu as pm
    scale = 1.0 / math.sqrt(c["D"])
    a = (c["bt"], c["lens"], c["pos"], c["sid"])
    kcap = int(sum(x + n for x, n in c["seqs"]))
    if impl == "ours":
        return lambda q, L: paged_prefill_attention(q, c["kc"], c["vc"], L, *a, scale=scale)
    if impl == "xla":
        return lambda q, L: paged_prefill_attention_ref(q, c["kc"], c["vc"], L, *a, scale=scale)
    if impl == "cudnn_gather":  # no tuning: it ran MgpuPrefillConfig(*None) (session 5)
        B, n = len(c["seqs"]), c["seqs"][0][1]
        shp = (B, n, c["Hq"], c["D"])

        def f(q, L):
            k, v = gather_dense(c, L)
            return jax.nn.dot_product_attention(
                q.reshape(shp), k, v, is_causal=True, scale=scale,
                implementation="cudnn").reshape(q.shape)
        return f
    cfg = pm.MgpuPrefillConfig(*tune)
    if impl == "mgpu_varlen":
        return lambda q, L: pm.paged_prefill_attention_mgpu(
            q, c["kc"], c["vc"], L, *a, scale=scale, kv_capacity=kcap, config=cfg,
            fallback=False)
    if impl == "mgpu_varlen_kernel":  # plan outside the timed step (layer L - 1 reused)
        kb, vb, rows, tiles, pairs, _ = pm.plan(c["kc"], c["vc"], c["L"] - 1, *a, 0,
                                               kv_capacity=kcap, cfg=cfg)
        Tq = rows.shape[1]

        def f(q, L):
            qp = jnp.pad(q, ((0, Tq - q.shape[0]), (0, 0), (0, 0)))
            return pm.varlen_attention(qp, kb, vb, rows, tiles, pairs, scale=scale,
                                       cfg=cfg)[: q.shape[0]]
        return f
    if impl in ("stock_mgpu_gather", "stock_mgpu"):
        B, n = len(c["seqs"]), c["seqs"][0][1]
        shp = (B, n, c["Hq"], c["D"])
        from jax.experimental.pallas.ops.gpu import attention_mgpu as am
        tc = am.TuningConfig(block_q=tune[0], block_kv=tune[1], max_concurrent_steps=tune[2],
                             causal=True)
        if impl == "stock_mgpu":  # K/V gathered and cast once, outside the timed step
            kd, vd = (x.astype(jnp.float16) for x in gather_dense(c, c["L"] - 1))
            return lambda q, L: am.attention((q.reshape(shp) * scale).astype(jnp.float16),
                                             kd, vd, tc).reshape(q.shape).astype(q.dtype)

        def f(q, L):
            k, v = (x.astype(jnp.float16) for x in gather_dense(c, L))
            o = am.attention((q.reshape(shp) * scale).astype(jnp.float16), k, v, tc)
            return o.reshape(q.shape).astype(q.dtype)
        return f
    raise ValueError(impl)


def measure(c: dict, impl: str, tune: tuple | None, repeats: int) -> dict:
    """Check against the reference at the last layer, then time a chain of CALLS calls."""
    f = paged_step(c, impl, tune)
    L = jnp.int32(c["L"] - 1)
    o = jax.jit(f)(c["q"], L)
    r = jax.jit(paged_prefill_attention_ref, static_argnames=("scale",))(
        c["q"], c["kc"], c["vc"], L, c["bt"], c["lens"], c["pos"], c["sid"],
        scale=1.0 / math.sqrt(c["D"]))
    err = rel_err(o, r)
    res = {"rel_err": err, "ok": err < 2e-2}
    if not res["ok"]:
        return res
    # stock_mgpu and the kernel-alone variant read one layer's K/V: the chain keeps L fixed.
    fixed = impl in ("stock_mgpu", "mgpu_varlen_kernel")

    def chain(q, *layers):
        for layer in layers:
            q = f(q, L if fixed else layer)
        return q
    args = [(c["q"], *[jnp.int32((s + i) % c["L"]) for i in range(CALLS)])
            for s in range(c["L"])]
    t = time_fn(jax.jit(chain), args, repeats, max_runs=50) / CALLS
    res.update(time_us=t * 1e6, tflops=c["flops"] / t / 1e12)
    return res


def worker(specs: list[dict], deadline: float, repeats: int) -> None:
    """Run Mosaic candidates in this process; one JSON line per event on stdout."""
    from jax._src.lib import cuda_versions
    ver = cuda_versions.cuda_runtime_get_version() if cuda_versions else None
    print(json.dumps({"event": "cuda", "runtime": ver}), flush=True)
    cases: dict = {}
    for i, sp in enumerate(specs):
        if time.time() > deadline:
            break
        print(json.dumps({"event": "start", "i": i}), flush=True)
        if sp["shape"] not in cases:
            cases.clear()
            cases[sp["shape"]] = make_case(SHAPES[sp["shape"]], seed=len(cases) + 7)
        c = cases[sp["shape"]]
        impls = [sp["impl"], sp["impl"] + ("_kernel" if sp["impl"] == "mgpu_varlen"
                                           else "_gather")]
        for impl in impls:
            try:
                res = measure(c, impl, tuple(sp["tune"]), repeats)
            except Exception as e:  # noqa: BLE001  report, go on
                res = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            print(json.dumps({"event": "result", "i": i, "impl": impl, **res}), flush=True)


def run_workers(specs: list[dict], deadline: float, repeats: int) -> list[dict]:
    """Worker subprocesses over ``specs``; restart after a crash, skipping the culprit."""
    results, todo = [], list(range(len(specs)))
    while todo and time.time() < deadline - 10:
        sub = [specs[i] for i in todo]
        cmd = [sys.executable, "-u", __file__, "--worker", json.dumps(sub),
               "--deadline", str(deadline - 5), "--repeats", str(repeats)]
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        started = None
        for line in p.stdout:
            if not line.startswith("{"):
                continue
            ev = json.loads(line)
            if ev["event"] == "start":
                started = ev["i"]
            elif ev["event"] == "result":
                ev.update(spec=sub[ev["i"]])
                results.append(ev)
                log_result(ev)
            else:
                log("worker", ev)
        try:
            rc = p.wait(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            p.kill()
            rc = -9
        if rc == 0 or started is None:
            break
        log(f"worker died (rc {rc}) at {sub[started]}; restarting after it")
        results.append({"impl": sub[started]["impl"], "spec": sub[started],
                        "error": f"worker crashed rc {rc}"})
        todo = todo[started + 1:]
    return results


def log_result(ev: dict) -> None:
    sp = ev.get("spec", {})
    tag = f"{ev['impl']}{list(sp['tune']) if sp.get('tune') else ''} {sp.get('shape')}"
    if "tflops" in ev:
        log(f"{tag}: {ev['time_us']:8.1f} us {ev['tflops']:6.1f} TFLOP/s err {ev['rel_err']:.1e}")
    else:
        log(f"{tag}: {ev.get('error') or ('BAD rel err %.2e' % ev.get('rel_err', -1))}")


def main() -> None:
    global T0
    T0 = time.time()  # deadlines and log stamps count from this run, not the import
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", ""))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--deadline-s", type=float, default=185.0)
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--list", action="store_true", help="print the candidates and exit")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(json.loads(args.worker), args.deadline, args.repeats)
    shapes = args.shapes.split(",")
    specs = mgpu_candidates(shapes)
    if args.list:
        for sp in specs:
            print(sp)
        return
    deadline = T0 + args.deadline_s
    recs = RunRecords("benchmarks/kernels/bench_prefill_mgpu.py", out_dir=args.out or None)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    log("devices", jax.devices(), "jax", jax.__version__)
    n = 8192
    x = jax.random.normal(jax.random.PRNGKey(0), (n, n), jnp.bfloat16)
    w = jax.random.normal(jax.random.PRNGKey(1), (n, n), jnp.bfloat16) / math.sqrt(n)
    mm_run = jax.jit(lambda x, w: functools.reduce(lambda a, _: a @ w, range(4), x))
    mm = 2 * n**3 / (time_fn(mm_run, [(x, w)], args.repeats, max_runs=100) / 4) / 1e12
    del x, w
    recs.add("matmul_bf16_rate", mm, "TFLOP/s", {"n": n, "op": "XLA x @ w bf16, chain of 4"})
    log(f"bf16 matmul {mm:.1f} TFLOP/s")

    results = []
    for shape in shapes:  # in-process candidates (Triton, XLA ref skipped, cuDNN)
        c = make_case(SHAPES[shape], seed=3)
        impls = ["ours"] + (["cudnn_gather"] if shape != "chunked_1024+512" else [])
        for impl in impls:
            try:
                res = measure(c, impl, None, args.repeats)
            except Exception as e:  # noqa: BLE001
                res = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            ev = {"impl": impl, "spec": {"shape": shape, "tune": None}, **res}
            results.append(ev)
            log_result(ev)
        del c
    results += run_workers(specs, deadline, args.repeats)

    for ev in results:
        sp = ev["spec"]
        cfg = {"shape": sp["shape"], "seqs": str(SHAPES[sp["shape"]]), "Hq": 32, "Hkv": 8,
               "D": 128, "page": 16, "tune": sp.get("tune"), "matmul_tflops": mm,
               **{k: ev[k] for k in ("rel_err", "time_us", "error") if k in ev}}
        name = f"prefill_mgpu/{ev['impl']}/{sp['shape']}"
        recs.add(name, ev.get("tflops"), "TFLOP/s", cfg)
    print(f"\nTFLOP/s on {jax.devices()[0].device_kind}, bf16 matmul {mm:.0f} TFLOP/s "
          f"(target 50 %: {mm / 2:.0f})")
    print(f"{'candidate':34s} {'shape':18s} {'TFLOP/s':>8s} {'/mm':>5s} {'err':>8s}")
    for ev in sorted(results, key=lambda e: (e["spec"]["shape"], -(e.get("tflops") or 0))):
        sp = ev["spec"]
        tag = ev["impl"] + (str(list(sp["tune"])) if sp.get("tune") else "")
        tf = ev.get("tflops")
        val = f"{tf:8.1f} {tf / mm:5.2f}" if tf else f"{'FAIL' if 'error' in ev else 'BAD':>8s} {'':5s}"
        print(f"{tag:34s} {sp['shape']:18s} {val} {ev.get('rel_err', float('nan')):8.1e}")


if __name__ == "__main__":
    main()
