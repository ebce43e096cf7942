"""GPU check and KV-bandwidth benchmark of paged decode attention.

Compares, in one run on one device: our Pallas kernel (pallas_kernels.paged_attention),
JAX's bundled Pallas paged_attention (Triton lowering), the jnp/XLA reference, and a
measured device copy bandwidth. Checks each of ours against the reference first
(relative L2 error, all outputs finite). Prints a table last and writes every number as
JSON records to ``--out/results.json``.

Timing: a jitted function chains ``CALLS`` kernel calls (each call's output is the next
call's query, so none can be skipped), over rotating layers of a stacked cache large enough
to defeat the 60 MB L2 where the shape allows; many runs are queued back to back and the
wall time is divided by the number of calls (median of ``--repeats``).

    PYTHONPATH=. python3 benchmarks/kernels/bench_paged_attention.py --out $OUT
    PYTHONPATH=. python benchmarks/kernels/bench_paged_attention.py --cpu-smoke  # on CPU

``--fp8-sweep`` runs the FP8-KV variant comparison instead (bench_paged_fp8.py).
``--sweep-set run1|run2|run3`` picks the tuning sweep of each recorded GPU run and
``--grid run3`` the short grid of run 3; the exact command is stored in every record.
Results and what was learned: benchmarks/kernels/NOTES_paged_attention.md.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import sys
import time
import traceback
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.kernels.kernel_bench import RunRecords, rel_err, time_fn
from pallas_kernels.paged_attention import paged_decode_attention, paged_decode_attention_ref

warnings.filterwarnings("ignore")
CALLS = 4
T0 = time.time()
RECORDS = RunRecords("benchmarks/kernels/bench_paged_attention.py")
ROWS: list[tuple] = []


def log(*a) -> None:
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def parse_heads(text: str) -> dict[str, int]:
    """'32/8/128' -> {"Hq": 32, "Hkv": 8, "D": 128} (:func:`make_case`'s keywords). Raises
    ValueError naming the text unless it is three integers with Hq a multiple of Hkv."""
    try:
        Hq, Hkv, D = (int(v) for v in text.split("/"))
        if Hkv <= 0 or Hq % Hkv:
            raise ValueError
    except ValueError:
        raise ValueError(f"heads {text!r}: give Hq/Hkv/D with Hq a multiple of Hkv") from None
    return {"Hq": Hq, "Hkv": Hkv, "D": D}


def make_case(B, ctx, Hq=32, Hkv=8, D=128, ps=16, kv_dtype=jnp.bfloat16, L=None, seed=0,
              tiny=False):
    """Random q, stacked caches [L, Hkv, P, ps, D], permuted block tables, lengths = ctx."""
    maxp = ctx // ps
    itemsize = jnp.dtype(kv_dtype).itemsize
    layer_bytes = 2 * B * ctx * Hkv * D * itemsize
    if L is None:
        L = 2 if tiny else int(min(8, max(2, math.ceil(512e6 / layer_bytes))))
    P = B * maxp + 1
    key = jax.random.PRNGKey(seed)
    kq, kk, kv, kp = jax.random.split(key, 4)
    q = jax.random.normal(kq, (B, Hq, D), jnp.bfloat16)
    kc = jax.random.normal(kk, (L, Hkv, P, ps, D), jnp.bfloat16)
    vc = jax.random.normal(kv, (L, Hkv, P, ps, D), jnp.bfloat16)
    scales = {}
    if kv_dtype == jnp.float8_e4m3fn:
        kc, vc = (kc / 0.05).astype(kv_dtype), (vc / 0.05).astype(kv_dtype)
        scales = {"k_scale": jnp.float32(0.05), "v_scale": jnp.float32(0.05)}
    bt = (jax.random.permutation(kp, P - 1) + 1).astype(jnp.int32).reshape(B, maxp)
    lens = jnp.full((B,), ctx, jnp.int32)
    return {"q": q, "kc": kc, "vc": vc, "bt": bt, "lens": lens, "L": L, "scales": scales,
            "ps": ps, "D": D,
                "Hkv": Hkv, "Hq": Hq, "B": B, "ctx": ctx, "kv_bytes_per_call": layer_bytes}


def calls_for(c) -> int:
    """More chained calls for small shapes, so host dispatch does not bound the timing."""
    return 16 if c["kv_bytes_per_call"] < 128e6 else CALLS


def chain(step, calls=CALLS):
    """jit(q, layers...) -> q after `calls` dependent calls of step(q, layer)."""
    def f(q, *args):
        for i in range(calls):
            q = step(q, i, *args)
        return q
    return jax.jit(f)


def layer_chain(c, step, state=None):
    """(run, args list) of ``calls_for(c)`` dependent ``step(state, i, kc, vc, bt, lens,
    *layers)`` calls over rotating layers (layer is a traced argument); the chain starts from
    ``state`` (default q), one args tuple per starting layer."""
    n = calls_for(c)
    L = c["L"]
    state = c["q"] if state is None else state
    args = [(state, c["kc"], c["vc"], c["bt"], c["lens"],
             *[jnp.int32((r * n + i) % L) for i in range(n)]) for r in range(L)]
    return chain(step, n), args


def ours_runner(c, window=0, **tune):
    """Runs of CALLS calls over rotating layers (layer is a traced argument)."""
    scale = 1.0 / math.sqrt(c["D"])

    def step(q, i, kc, vc, bt, lens, *layers):
        return paged_decode_attention(q, kc, vc, layers[i], bt, lens, scale=scale,
                                      window=window, **c["scales"], **tune)
    return layer_chain(c, step)


def stock_runner(c, interpret=False):
    """JAX's bundled kernel takes one layer [Hkv, P, ps, D]: give it per-layer arrays."""
    from jax.experimental.pallas.ops.gpu import paged_attention as stock
    scale = 1.0 / math.sqrt(c["D"])
    L = c["L"]
    ks = [c["kc"][i] for i in range(L)]
    vs = [c["vc"][i] for i in range(L)]
    kw = {"interpret": interpret}
    maxp = c["bt"].shape[1]
    kw["k_splits"] = min(16, maxp)
    kw["pages_per_compute_block"] = min(8, maxp // kw["k_splits"])

    def step(q, i, bt, lens, *kv):
        return stock.paged_attention(q * scale, kv[2 * i], kv[2 * i + 1], bt, lens, **kw)
    n = calls_for(c)
    run = chain(step, n)
    args = []
    for r in range(L):
        kv = []
        for i in range(n):
            j = (r * n + i) % L
            kv += [ks[j], vs[j]]
        args.append((c["q"], c["bt"], c["lens"], *kv))
    return run, args


def ref_runner(c, window=0):
    scale = 1.0 / math.sqrt(c["D"])

    def step(q, i, kc, vc, bt, lens, *layers):
        return paged_decode_attention_ref(q, kc, vc, layers[i], bt, lens, scale=scale,
                                          window=window, **c["scales"])
    n = calls_for(c)
    run = chain(step, n)
    L = c["L"]
    args = [(c["q"], c["kc"], c["vc"], c["bt"], c["lens"],
             *[jnp.int32((r * n + i) % L) for i in range(n)]) for r in range(L)]
    return run, args


def check(c, window=0, **tune) -> float:
    scale = 1.0 / math.sqrt(c["D"])
    q = c["q"]
    lens = c["lens"]
    # ragged lengths incl. 1 and a page boundary exercise masking at real shapes
    lens = jnp.asarray(np.random.default_rng(1).integers(1, c["ctx"] + 1, c["B"]), jnp.int32)
    lens = lens.at[0].set(1).at[-1].set(c["ctx"]).at[len(lens) // 2].set(c["ps"] * 3)
    o = jax.jit(lambda *a: paged_decode_attention(*a, scale=scale, window=window,
                                                  **c["scales"], **tune))(
        q, c["kc"], c["vc"], jnp.int32(c["L"] - 1), c["bt"], lens)
    r = jax.jit(lambda *a: paged_decode_attention_ref(*a, scale=scale, window=window,
                                                      **c["scales"]))(
        q, c["kc"], c["vc"], jnp.int32(c["L"] - 1), c["bt"], lens)
    return rel_err(o, r)


def record(name, value, unit, config, args) -> None:
    RECORDS.out_dir = args.out
    RECORDS.add(name, value, unit, config)


def copy_bandwidth(args) -> float:
    n = (1 << 20) if args.cpu_smoke else (1 << 30)  # bf16 elements: 2 GiB

    def step(x, i):
        return jax.lax.optimization_barrier(-x)  # x * 1 was simplified away by XLA
    run = jax.jit(lambda x: functools.reduce(step, range(CALLS), x))
    best = 0.0
    for dt in (jnp.bfloat16, jnp.float32):
        x = jax.random.normal(jax.random.PRNGKey(0), (n * 2 // jnp.dtype(dt).itemsize,), dt)
        t = time_fn(run, [(x,)], args.repeats) / CALLS
        bw = 2 * x.nbytes / t / 1e9
        record("copy_bandwidth", bw, "GB/s", {"op": f"-x ({jnp.dtype(dt).name}), XLA",
                                                  "bytes_read_plus_written": 2 * x.nbytes,
                                                  "time_us": t * 1e6}, args)
        best = max(best, bw)
        del x
    return best


def bench_point(label, c, args, impls, window=0, tune=None, sweep=False):
    """Time the requested implementations at one shape; returns {impl: GB/s}."""
    tune = tune or {}
    eff_tokens = min(c["ctx"], window) if window else c["ctx"]
    kv_bytes = c["kv_bytes_per_call"] * eff_tokens / c["ctx"]
    cfg = {"B": c["B"], "ctx": c["ctx"], "Hq": c["Hq"], "Hkv": c["Hkv"], "D": c["D"],
           "page": c["ps"],
               "kv_dtype": str(c["kc"].dtype), "window": window, "layers": c["L"],
               "kv_bytes_per_call": kv_bytes, "calls_per_run": calls_for(c)}
    out = {}
    for impl in impls:
        try:
            if impl == "ours":
                run, a = ours_runner(c, window=window, interpret=args.cpu_smoke, **tune)
            elif impl == "stock":
                run, a = stock_runner(c, interpret=args.cpu_smoke)
            else:
                run, a = ref_runner(c, window=window)
            t = time_fn(run, a, args.repeats) / calls_for(c)
            bw = kv_bytes / t / 1e9
            out[impl] = bw
            name = f"paged_decode/{'sweep/' if sweep else ''}{impl}/{label}"
            record(name, bw, "GB/s",
                   dict(cfg, impl=impl, time_us=t * 1e6, **{k: str(v) if not isinstance(
                       v, int) else v for k, v in tune.items()}), args)
            log(f"{name}: {t * 1e6:8.1f} us  {bw:8.1f} GB/s  {tune if impl == 'ours' else ''}")
        except Exception as e:  # noqa: BLE001  one failing variant must not lose the run
            log(f"FAILED {impl} {label} {tune}: {type(e).__name__}: {str(e)[:300]}")
            out[impl] = None
    return out


def main() -> None:
    global T0
    T0 = time.time()  # deadlines and log stamps count from this run, not the import
    if "--fp8-sweep" in sys.argv:  # FP8-KV variants vs bf16: bench_paged_fp8.py
        from benchmarks.kernels import bench_paged_fp8
        return bench_paged_fp8.main(sys.argv[1:])
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", ""))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes, interpret mode")
    p.add_argument("--deadline-s", type=float, default=250.0)
    p.add_argument("--no-sweep", action="store_true")
    p.add_argument("--quick-checks", action="store_true")
    p.add_argument("--sweep-set", default="run2", choices=["run1", "run2", "run3"])
    p.add_argument("--grid", default="full", choices=["full", "run3"])
    args = p.parse_args()
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    tiny = args.cpu_smoke
    log("devices", jax.devices(), "jax", jax.__version__)
    mk = functools.partial(make_case, tiny=tiny)
    if tiny:
        args.repeats = 1
        grid = [(1, 256), (2, 128)]
        extras = []
    elif args.grid == "run3":  # the points whose default changed after run 2
        grid = [(8, 1024), (8, 2048), (8, 4096), (1, 2048), (1, 4096), (1, 32768)]
        extras = [("fp8", {"B": 32, "ctx": 2048, "kv_dtype": jnp.float8_e4m3fn})]
    else:
        grid = [(32, 2048), (128, 1024), (1, 32768), (1, 4096), (32, 4096), (128, 2048),
                (8, 2048), (8, 4096), (32, 1024), (128, 4096), (8, 1024), (1, 1024), (1, 2048)]
        extras = [("page32", {"B": 32, "ctx": 2048, "ps": 32}),
                  ("page64", {"B": 32, "ctx": 2048, "ps": 64}),
                  ("D64", {"B": 32, "ctx": 2048, "D": 64}),
                  ("D256", {"B": 32, "ctx": 2048, "D": 256}),
                  ("fp8", {"B": 32, "ctx": 2048, "kv_dtype": jnp.float8_e4m3fn}),
                  ("fp8", {"B": 1, "ctx": 32768, "kv_dtype": jnp.float8_e4m3fn}),
                  ("win1024", {"B": 32, "ctx": 4096})]
    copy_bw = copy_bandwidth(args)
    log(f"copy bandwidth {copy_bw:.0f} GB/s")

    # 1. correctness at real shapes (ragged lengths) before any timing
    checks = [{"B": 32, "ctx": 2048}, {"B": 1, "ctx": 32768}, {"B": 8, "ctx": 1024, "ps": 64},
              {"B": 8, "ctx": 1024, "D": 256}, {"B": 8, "ctx": 1024, "D": 64},
              {"B": 8, "ctx": 2048, "kv_dtype": jnp.float8_e4m3fn}]
    if args.quick_checks:
        checks = [checks[0], checks[3], checks[5]]
    if tiny:
        checks = [{"B": 2, "ctx": 128}, {"B": 2, "ctx": 128, "kv_dtype": jnp.float8_e4m3fn}]
    for n, kw in enumerate(checks):
        for window in ((0, 700) if kw in (checks[0], checks[-1]) else (0,)):
            c = mk(**kw, L=2)
            try:
                e = check(c, window=window, interpret=tiny)
            except Exception as ex:  # noqa: BLE001  record and go on
                e = float("nan")
                log("check FAILED", kw, type(ex).__name__, str(ex)[:300])
            ok = e < 2e-2
            record("paged_decode/check_rel_err/" + "_".join(f"{k}{v}" for k, v in kw.items()),
                   e, "rel_l2", dict({k: str(v) for k, v in kw.items()}, window=window, ok=ok),
                   args)
            log(f"check {kw} window={window}: rel err {e:.2e} {'OK' if ok else 'BAD'}")
            del c

    # 2. tuning sweeps (run1: the first, broad one; run2: fp8, small batch, D = 64)
    T = lambda bt, w, st, tp=None, **kw: dict(block_tokens=bt, num_warps=w, num_stages=st,
                                               target_programs=tp, **kw)
    if args.sweep_set == "run1":
        base = [T(128, 4, 3, 264), T(64, 4, 3, 264), T(64, 4, 5, 264), T(128, 4, 5, 264),
                T(64, 8, 5, 264), T(128, 8, 5, 264), T(64, 4, 5, 528), T(64, 4, 5, 132),
                T(128, 4, 3, 528), T(32, 4, 5, 528), T(256, 8, 2, 264), T(64, 2, 5, 528)]
        sweeps = [({"B": 32, "ctx": 2048}, base), ({"B": 1, "ctx": 32768}, base[:9])]
    elif args.sweep_set == "run3":
        f8 = {"kv_dtype": jnp.float8_e4m3fn}
        sweeps = [
            (dict(B=32, ctx=2048, **f8), [T(64, 4, 5, 264), T(64, 4, 5, 528), T(128, 4, 5, 264),
                                          T(64, 2, 5, 264), T(32, 4, 5, 264), T(128, 4, 4),
                                          T(128, 2, 5)]),
            (dict(B=1, ctx=32768, **f8), [T(64, 2, 5, 264), T(32, 4, 5, 264)]),
            ({"B": 1, "ctx": 2048}, [T(64, 4, 5, 132), T(128, 4, 5, 264), T(128, 4, 5, 132),
                                   T(64, 4, 5, 264)]),
            ({"B": 1, "ctx": 4096}, [T(64, 4, 5, 132), T(128, 4, 5, 264), T(128, 4, 5, 132)]),
        ]
    else:
        f8 = {"kv_dtype": jnp.float8_e4m3fn}
        sweeps = [
            (dict(B=32, ctx=2048, **f8), [T(64, 4, 5), T(128, 4, 5), T(128, 4, 3),
                                          T(256, 8, 3), T(128, 8, 5), T(256, 4, 3),
                                          T(128, 4, 5, fp8_compute_dtype=jnp.bfloat16)]),
            (dict(B=1, ctx=32768, **f8), [T(64, 4, 5), T(128, 4, 5), T(128, 4, 3),
                                          T(128, 4, 5, 528), T(256, 8, 3)]),
            ({"B": 8, "ctx": 4096}, [T(64, 4, 5, 132), T(64, 4, 5, 264), T(64, 4, 5, 528),
                                   T(128, 4, 3, 264)]),
            ({"B": 32, "ctx": 2048}, [T(128, 4, 5), T(128, 4, 4), T(64, 4, 4)]),
            ({"B": 32, "ctx": 2048, "D": 64}, [T(64, 4, 5), T(128, 4, 5), T(128, 4, 3)]),
        ]
    if tiny:
        sweeps = [({"B": 2, "ctx": 128}, [T(64, 4, 5), T(32, 4, 3)])]
    if not args.no_sweep:
        for shape, tunes in sweeps:
            c = mk(**shape)
            for tune in tunes:
                if time.time() - T0 > args.deadline_s * 0.5:
                    break
                tune = {k: v for k, v in tune.items() if v is not None}
                bench_point("_".join(f"{k}{v}" for k, v in shape.items() if k != "kv_dtype")
                            + ("_fp8" if "kv_dtype" in shape else ""), c, args, ["ours"],
                            tune=tune, sweep=True)
            del c

    # 3. the grid: ours vs stock vs XLA reference
    for B, ctx in grid:
        if time.time() - T0 > args.deadline_s:
            log("deadline: skipping", B, ctx)
            continue
        c = mk(B, ctx)
        impls = ["ours", "stock"] if args.grid == "run3" else ["ours", "stock", "xla"]
        bw = bench_point(f"B{B}_ctx{ctx}", c, args, impls)
        ROWS.append((f"B{B} ctx{ctx}", bw))
        del c
    for label, kw in extras:
        if time.time() - T0 > args.deadline_s:
            log("deadline: skipping", label, kw)
            continue
        window = 1024 if label.startswith("win") else 0
        c = mk(**kw)
        tune = {}
        impls = ["ours"] if (window or "fp8" in label) else ["ours", "stock", "xla"]
        bw = bench_point(f"{label}_B{c['B']}_ctx{c['ctx']}", c, args, impls, window=window,
                         tune=tune)
        ROWS.append((f"{label} B{c['B']} ctx{c['ctx']}", bw))
        del c

    print(f"\nKV GB/s on {jax.devices()[0].device_kind} (copy {copy_bw:.0f} GB/s read+write)")
    print(f"{'shape':24s} {'ours':>8s} {'stock':>8s} {'xla':>8s} {'ours/stock':>10s}")
    def f(bw: dict, k: str) -> str:
        return f"{bw[k]:8.0f}" if bw.get(k) else f"{'-':>8s}"

    for name, bw in ROWS:
        ratio = (f"{bw['ours'] / bw['stock']:10.2f}" if bw.get("ours") and bw.get("stock")
                 else f"{'-':>10s}")
        print(f"{name:24s} {f(bw, 'ours')} {f(bw, 'stock')} {f(bw, 'xla')} {ratio}")


if __name__ == "__main__":
    try:
        main()
    except Exception:
        traceback.print_exc()
        raise
