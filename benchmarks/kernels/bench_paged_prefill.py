"""GPU check and TFLOP/s benchmark of paged prefill attention.

Compares, in one run on one device: our Pallas kernel (pallas_kernels.paged_attention
.paged_prefill_attention), the jnp/XLA reference (paged_prefill_attention_ref), cuDNN flash
attention through ``jax.nn.dot_product_attention(implementation="cudnn")`` and JAX's stock
Pallas Triton flash attention (``pallas.ops.gpu.attention.mha``) on the same q/k/v laid out
contiguously (no pages: an upper reference, not the same job), and the measured XLA bf16
matmul rate (8192^3). Correctness first: every check compares ours with the reference at
real shapes (ragged packing, chunked prefill, window, FP8, D 64/256) by relative L2 error.

TFLOP/s = 4 * Hq * D * (query-key pairs the causal mask keeps) / time; for one fresh
sequence of n tokens the pairs are n(n+1)/2 (the usual 2*2*n*n/2*Hq*D within 0.03 %).
Timing: a jitted chain of calls (each call's output is the next call's query) over rotating
layers of a stacked cache, runs queued back to back, median of ``--repeats``.

    PYTHONPATH=. python3 benchmarks/kernels/bench_paged_prefill.py --out $OUT
    PYTHONPATH=. python benchmarks/kernels/bench_paged_prefill.py --cpu-smoke   # on CPU

Results: ``--out/results.json`` (one record per number, with the command); table last.
Notes: benchmarks/kernels/NOTES_paged_prefill.md.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import time
import traceback
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.kernels.kernel_bench import RunRecords, rel_err, time_fn
from pallas_kernels.paged_attention import paged_prefill_attention, paged_prefill_attention_ref

warnings.filterwarnings("ignore")
T0 = time.time()
RECORDS = RunRecords("benchmarks/kernels/bench_paged_prefill.py")
ROWS: list[tuple[str, dict]] = []
ARGS: argparse.Namespace


def log(*a) -> None:
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def late(frac: float = 1.0) -> bool:
    return time.time() - T0 > ARGS.deadline_s * frac


def record(name: str, value: float, unit: str, config: dict) -> None:
    RECORDS.out_dir = ARGS.out
    RECORDS.add(name, value, unit, config)


def make_case(seqs: list[tuple[int, int]], *, Hq=32, Hkv=8, D=128, ps=16, kv_dtype=jnp.bfloat16,
              window=0, L=2, pad=0, seed=0) -> dict:
    """seqs: (cached, new) tokens per sequence, packed contiguously (then ``pad`` padding
    tokens); random stacked caches [L, Hkv, P, ps, D] and permuted block tables."""
    maxp = max(-(-(c + n) // ps) for c, n in seqs)
    S, P = len(seqs), len(seqs) * maxp + 1
    kq, kk, kv, kp = jax.random.split(jax.random.PRNGKey(seed), 4)
    pos = np.concatenate([np.arange(c, c + n) for c, n in seqs] + [np.zeros(pad, int)])
    sid = np.concatenate([np.full(n, s) for s, (_, n) in enumerate(seqs)] + [np.full(pad, -1)])
    T = len(pos)
    kc = jax.random.normal(kk, (L, Hkv, P, ps, D), jnp.bfloat16)
    vc = jax.random.normal(kv, (L, Hkv, P, ps, D), jnp.bfloat16)
    scales = {}
    if kv_dtype == jnp.float8_e4m3fn:
        kc, vc = (kc / 0.05).astype(kv_dtype), (vc / 0.05).astype(kv_dtype)
        scales = {"k_scale": jnp.float32(0.05), "v_scale": jnp.float32(0.05)}
    pairs = sum(min(p + 1, window) if window else p + 1 for p in pos[: T - pad])
    return {"q": jax.random.normal(kq, (T, Hq, D), jnp.bfloat16), "kc": kc, "vc": vc,
            "bt": (jax.random.permutation(kp, P - 1) + 1).astype(jnp.int32).reshape(S, maxp),
            "lens": jnp.asarray([c + n for c, n in seqs], jnp.int32),
            "pos": jnp.asarray(pos, jnp.int32), "sid": jnp.asarray(sid, jnp.int32),
            "scales": scales, "window": window, "L": L, "seqs": seqs, "D": D, "Hq": Hq,
            "Hkv": Hkv, "ps": ps, "flops": 4.0 * Hq * D * pairs}


def paged_runner(c: dict, fn, calls: int, **kw):
    """jit(q, caches, tables, layers...) chaining `calls` calls over rotating layers."""
    scale = 1.0 / math.sqrt(c["D"])
    f = functools.partial(fn, scale=scale, window=c["window"], **c["scales"], **kw)

    def chain(q, kc, vc, bt, lens, pos, sid, *layers):
        for layer in layers:
            q = f(q, kc, vc, layer, bt, lens, pos, sid)
        return q
    args = [(c["q"], c["kc"], c["vc"], c["bt"], c["lens"], c["pos"], c["sid"],
             *[jnp.int32((r + i) % c["L"]) for i in range(calls)]) for r in range(c["L"])]
    return jax.jit(chain), args


def dense_runner(c: dict, impl: str, calls: int):
    """cuDNN / stock Pallas flash attention on contiguous [B, n, H, D] copies (one fresh
    sequence length n per batch row; only for cases with equal lengths and no cache)."""
    (_, n), B = c["seqs"][0], len(c["seqs"])
    q = c["q"].reshape(B, n, c["Hq"], c["D"])
    k = jax.random.normal(jax.random.PRNGKey(1), (B, n, c["Hkv"], c["D"]), jnp.bfloat16)
    v = jax.random.normal(jax.random.PRNGKey(2), (B, n, c["Hkv"], c["D"]), jnp.bfloat16)
    scale = 1.0 / math.sqrt(c["D"])
    if impl == "cudnn":
        step = functools.partial(jax.nn.dot_product_attention, is_causal=True, scale=scale,
                                 implementation="cudnn")
    else:
        from jax.experimental.pallas.ops.gpu import attention as stock
        G = c["Hq"] // c["Hkv"]
        k, v = jnp.repeat(k, G, axis=2), jnp.repeat(v, G, axis=2)  # stock mha: no GQA
        step = functools.partial(stock.mha, segment_ids=None, sm_scale=scale, causal=True,
                                 interpret=ARGS.cpu_smoke)

    def chain(q, k, v):
        for _ in range(calls):
            q = step(q, k, v)
        return q
    return jax.jit(chain), [(q, k, v)]


def check(label: str, c: dict, **tune) -> None:
    scale = 1.0 / math.sqrt(c["D"])
    a = (c["q"], c["kc"], c["vc"], jnp.int32(c["L"] - 1), c["bt"], c["lens"], c["pos"], c["sid"])
    try:
        o = jax.jit(functools.partial(paged_prefill_attention, scale=scale, window=c["window"],
                                      interpret=ARGS.cpu_smoke, **c["scales"], **tune))(*a)
        r = jax.jit(functools.partial(paged_prefill_attention_ref, scale=scale,
                                      window=c["window"], **c["scales"]))(*a)
        pad = np.asarray(c["sid"]) < 0
        e = rel_err(o, r) if np.all(np.asarray(o, np.float32)[pad] == 0) else float("inf")
    except Exception as ex:  # noqa: BLE001  record and go on
        e = float("nan")
        log("check FAILED", label, type(ex).__name__, str(ex)[:400])
    ok = e < 2e-2
    record(f"paged_prefill/check_rel_err/{label}", e, "rel_l2",
           {"seqs": str(c["seqs"]), "D": c["D"], "kv": str(c["kc"].dtype), "ok": ok, **tune})
    log(f"check {label}: rel err {e:.2e} {'OK' if ok else 'BAD'}")


def bench(label: str, c: dict, impls: list[str], tune: dict | None = None,
          sweep: bool = False) -> dict:
    tune = tune or {}
    out: dict = {}
    for impl in impls:
        if late():
            log("deadline: skipping", label, impl, tune)
            continue
        calls = 2 if ARGS.cpu_smoke else 4
        try:
            if impl == "ours":
                run, a = paged_runner(c, paged_prefill_attention, calls,
                                      interpret=ARGS.cpu_smoke, **tune)
            elif impl == "xla":
                run, a = paged_runner(c, paged_prefill_attention_ref, calls)
            else:
                run, a = dense_runner(c, impl, calls)
            t = time_fn(run, a, ARGS.repeats, max_runs=100) / calls
        except Exception as e:  # noqa: BLE001  one failing variant must not lose the run
            log(f"FAILED {impl} {label} {tune}: {type(e).__name__}: {str(e)[:300]}")
            continue
        tf = c["flops"] / t / 1e12
        out[impl] = tf
        name = f"paged_prefill/{'sweep/' if sweep else ''}{impl}/{label}"
        record(name, tf, "TFLOP/s", {"seqs": str(c["seqs"]), "T": int(c["q"].shape[0]),
                                      "Hq": c["Hq"], "Hkv": c["Hkv"], "D": c["D"],
                                      "page": c["ps"], "kv_dtype": str(c["kc"].dtype),
                                      "window": c["window"], "time_us": t * 1e6,
                                      "flops": c["flops"], **tune})
        log(f"{name}: {t * 1e6:9.1f} us {tf:7.1f} TFLOP/s {tune if impl == 'ours' else ''}")
    return out


def matmul_rate() -> float:
    n = 512 if ARGS.cpu_smoke else 8192
    x = jax.random.normal(jax.random.PRNGKey(0), (n, n), jnp.bfloat16)
    w = jax.random.normal(jax.random.PRNGKey(1), (n, n), jnp.bfloat16) / math.sqrt(n)
    run = jax.jit(lambda x, w: functools.reduce(lambda a, _: a @ w, range(4), x))
    t = time_fn(run, [(x, w)], ARGS.repeats, max_runs=100) / 4
    tf = 2 * n**3 / t / 1e12
    record("matmul_bf16_rate", tf, "TFLOP/s", {"n": n, "op": "XLA x @ w bf16, chain of 4",
                                                "time_us": t * 1e6})
    return tf


def main() -> None:
    global T0
    T0 = time.time()  # deadlines and log stamps count from this run, not the import
    global ARGS
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", ""))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--deadline-s", type=float, default=240.0)
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes, interpret mode")
    p.add_argument("--no-sweep", action="store_true")
    ARGS = p.parse_args()
    if ARGS.out:
        os.makedirs(ARGS.out, exist_ok=True)
    tiny = ARGS.cpu_smoke
    if tiny:
        ARGS.repeats = 1
    log("devices", jax.devices(), "jax", jax.__version__)
    mm = matmul_rate()
    log(f"bf16 matmul rate {mm:.1f} TFLOP/s")

    n1, n8 = (128, 32) if tiny else (4096, 512)
    mk = functools.partial(make_case, **({"Hq": 4, "Hkv": 2, "D": 64} if tiny else {}))
    # 1. correctness at real shapes (ragged, chunked, padding, window, fp8, D 64 / 256)
    conservative = {"block_m": 128, "block_k": 64, "num_warps": 8, "num_stages": 3}
    checks = [("1x4096", mk([(0, n1)])),
              ("1x4096_m128k64w8s3", mk([(0, n1)]), conservative),
              ("ragged_chunked_pad", mk([(0, 1), (0, 16), (700 // (32 if tiny else 1), 37),
                                         (0, n8 + 5), (n8, n8 - 3)], pad=11)),
              ("window700_1x4096", mk([(0, n1)], window=700 // (8 if tiny else 1))),
              ("fp8_8x512", mk([(0, n8)] * 8, kv_dtype=jnp.float8_e4m3fn))]
    if not tiny:
        checks += [("D64_G1_4x512", make_case([(0, 512)] * 4, Hq=16, Hkv=16, D=64)),
                   ("D256_G2_chunked", make_case([(1000, 300), (0, 700)], Hq=8, Hkv=4, D=256,
                                                 ps=32, window=512))]
    for label, c, *tune in checks:
        if not late(0.4):
            check(label, c, **(tune[0] if tune else {}))
        del c
    del checks

    # 2. the main points: ours vs the XLA reference vs flash attention without pages
    main_pts = [("1x4096", [(0, n1)]), ("8x512", [(0, n8)] * 8)]
    impls = ["ours", "xla", "cudnn", "stock_triton"]
    if tiny:
        impls = ["ours", "xla"]
    for label, seqs in main_pts:
        c = mk(seqs)
        ROWS.append((label, bench(label, c, impls)))
        del c

    # 3. tile sweep at 1 x 4096 (defaults: m128 k64 w8 s5 at D = 128)
    T = lambda m, k, w, s, **kw: {"block_m": m, "block_k": k, "num_warps": w, "num_stages": s,
                                  **kw}
    sweep = [T(128, 128, 8, 5), T(128, 128, 8, 2), T(128, 64, 8, 3), T(128, 32, 8, 5),
             T(64, 64, 4, 5), T(128, 64, 8, 5, reverse=False), T(128, 128, 8, 3)]
    if tiny:
        sweep = [T(32, 16, 4, 2)]
    if not ARGS.no_sweep:
        c = mk([(0, n1)])
        for tune in sweep:
            if late(0.75):
                break
            bench("1x4096", c, ["ours"], tune=tune, sweep=True)
        del c

    # 4. extras: chunked prefill, window, fp8, other head dims (ours and the XLA ref)
    extras = [("chunked_4x(1024+512)", mk([(n8 * 2, n8)] * 4), ["ours"]),
              ("window1024_1x4096", mk([(0, n1)], window=n1 // 4), ["ours"]),
              ("fp8_1x4096", mk([(0, n1)], kv_dtype=jnp.float8_e4m3fn), ["ours"])]
    if not tiny:
        extras += [("D64_Hq16_Hkv16_1x4096", make_case([(0, 4096)], Hq=16, Hkv=16, D=64),
                    ["ours", "cudnn"]),
                   ("D256_Hq8_Hkv4_1x4096", make_case([(0, 4096)], Hq=8, Hkv=4, D=256),
                    ["ours", "cudnn"])]
    for label, c, imp in extras:
        ROWS.append((label, bench(label, c, imp)))
        del c

    print(f"\nTFLOP/s on {jax.devices()[0].device_kind} (bf16 matmul {mm:.0f} TFLOP/s)")
    print(f"{'shape':28s} {'ours':>7s} {'xla':>7s} {'cudnn':>7s} {'stock':>7s} {'ours/mm':>8s}")

    def f(d: dict, k: str) -> str:
        return f"{d[k]:7.1f}" if d.get(k) else f"{'-':>7s}"
    for name, d in ROWS:
        frac = f"{d['ours'] / mm:8.2f}" if d.get("ours") else f"{'-':>8s}"
        print(f"{name:28s} {f(d, 'ours')} {f(d, 'xla')} {f(d, 'cudnn')} "
              f"{f(d, 'stock_triton')} {frac}")


if __name__ == "__main__":
    try:
        main()
    except Exception:
        traceback.print_exc()
        raise
