"""GPU check and timing of the Mosaic GPU paged decode kernel (decode_mgpu.py) on an H200.

Issue #3's open target: FP8 KV decode at bf16's GB/s, i.e. time <= 0.5x the bf16 kernel's at
the same (B, ctx). Llama-3.1-8B heads (Hq 32, Hkv 8, D 128, page 16), shapes B32 ctx2048,
B128 ctx1024, B128 ctx2048, B1 ctx32768. In this order, results written after each value:

1. (this process) the Triton kernels' defaults at each shape: bf16 (the ratio's
   denominator) and FP8 (``fp8_variant="by_batch"``, today's default);
2. (child processes, so a CUDA fault or a hung barrier costs one variant, not the run; a
   child that dies is restarted at the next variant) each Mosaic variant: first a check
   against the jnp reference on the same FP8 (or bf16) cache at each shape, fresh random
   inputs, ragged lengths (1, a page boundary, the full context; B = 1: ctx - 5), NaN in
   every slot the kernel must not read (the reference reads the clean cache); a variant
   that fails (non-finite or rel. L2 error >= 2e-2) is not timed; then the timing with
   ``kernel_bench.time_fn`` over ``bench_paged_attention``'s chains of calls over rotating
   layers (L2-defeating), median of ``--repeats``;
3. a table last: µs per call, GB/s of KV bytes, time over bf16's (0.5 = the target).

    PYTHONPATH=. python3 benchmarks/kernels/check_decode_mgpu.py --out $OUT   # H200, ~100 s
    PYTHONPATH=. python benchmarks/kernels/check_decode_mgpu.py --smoke \
        --variants mgpu_t64_s4,mgpu_bf16_t64_s4 --deadline-s 300    # CPU: checks only

Records: ``--out/results_decode_mgpu.json`` (jaxinfer.bench.records format).
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # children share the GPU

import argparse
import functools
import json
import math
import select
import subprocess
import sys
import tempfile
import time
import traceback
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.kernels.bench_paged_attention import (
    calls_for,
    chain,
    make_case,
    ours_runner,
)
from benchmarks.kernels.kernel_bench import RunRecords, time_fn
from pallas_kernels.paged_attention import paged_decode_attention_ref
from pallas_kernels.paged_attention.decode_mgpu import (
    MgpuDecodeConfig,
    paged_decode_attention_mgpu,
)

warnings.filterwarnings("ignore")
T0 = time.time()
F8 = jnp.float8_e4m3fn
SHAPES = [(32, 2048), (128, 1024), (128, 2048), (1, 32768)]
SMOKE_SHAPES = [(3, 128), (1, 256)]
CHECK_LIMIT = 2e-2
# (name, cache, MgpuDecodeConfig kwargs), in priority order (the deadline drops the tail).
# Smem a CTA (FP8): ring 2 x stages x block_tokens x 128 B + staging + q.
VARIANTS: list[tuple[str, str, dict]] = [
    ("mgpu_t64_s4", "fp8", {}),  # default: 96 KB, 2 warpgroups
    ("mgpu_h2_t64_s4", "fp8", {"heads_per_cta": 2}),  # 2 KV heads, 2 + 1 warpgroups: 192 KB
    ("mgpu_h2_t64_s4_up2x", "fp8", {"heads_per_cta": 2, "v_layout": "WGMMA_UPCAST_2X"}),
    ("mgpu_t128_s2", "fp8", {"block_tokens": 128, "stages": 2}),  # 112 KB
    ("mgpu_t64_s4_up2x", "fp8", {"v_layout": "WGMMA_UPCAST_2X"}),  # V: 4-byte smem loads
    ("mgpu_bf16_t64_s4", "bf16", {}),  # the same kernel on the bf16 cache: 160 KB
    ("mgpu_t64_s2", "fp8", {"stages": 2}),  # 64 KB: more CTAs an SM if registers allow
    ("mgpu_t64_s4_q1", "fp8", {"q_terms": 1}),  # one e4m3 term of q: cost of the second
    ("mgpu_h2_t64_s3", "fp8", {"heads_per_cta": 2, "stages": 3}),
    ("mgpu_t64_s4_psmem", "fp8", {"p_smem": True}),  # P through shared memory
    # setmaxnreg (may hang if the register pool is short): last
    ("mgpu_h2_t64_s4_regs232", "fp8", {"heads_per_cta": 2, "regs": (232, 40)}),
    ("mgpu_t64_s4_regs168", "fp8", {"regs": (168, 40)}),
]
# Run next (once) after a variant fails or dies: the code path the CPU interpreter tests
# (P through shared memory, P V into a fresh accumulator), to tell a GPU-only bug from one
# of the default path's P-in-registers / in-place accumulation.
DIAGNOSTIC = ("mgpu_t64_s4_interp_path", "fp8", {"p_smem": True, "fresh_acc": True})
_MGPU = jax.jit(paged_decode_attention_mgpu, static_argnames=("scale", "config", "interpret"))


def log(*a) -> None:
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def check_inputs(c) -> tuple[tuple, tuple]:
    """(kernel args with NaN in every unread slot of the last layer, reference args)."""
    B, ctx, ps = c["B"], c["ctx"], c["ps"]
    if B == 1:
        lens = np.array([ctx - 5])
    else:
        lens = np.random.default_rng(1).integers(1, ctx + 1, B)
        lens[0], lens[1], lens[2], lens[-1] = 1, ctx, 3 * ps, ps + 1
    lens = jnp.asarray(lens, jnp.int32)
    bt, kc, vc = c["bt"], c["kc"], c["vc"]
    pos = jnp.arange(bt.shape[1] * ps)
    ok = pos[None, :] < lens[:, None]  # [B, maxp * ps]
    readable = jnp.zeros(kc.shape[2:4], bool).at[bt[:, pos // ps], pos % ps].set(ok)
    last = c["L"] - 1

    def poison(x):
        nan = jnp.asarray(jnp.nan, x.dtype)
        return x.at[last].set(jnp.where(readable[None, :, :, None], x[last], nan))
    layer = jnp.int32(last)
    return ((c["q"], poison(kc), poison(vc), layer, bt, lens),
            (c["q"], kc, vc, layer, bt, lens))


def errors(o, r) -> tuple[float, float]:
    """(relative L2 error, max abs error) in float64; inf if ``o`` has a non-finite."""
    o, r = np.asarray(o, np.float64), np.asarray(r, np.float64)
    if not np.all(np.isfinite(o)):
        return float("inf"), float("inf")
    return (float(np.linalg.norm(o - r) / max(np.linalg.norm(r), 1e-30)),
            float(np.abs(o - r).max()))


def mgpu_runner(c, cfg: MgpuDecodeConfig):
    """``bench_paged_attention.ours_runner`` for the Mosaic kernel (chains over layers)."""
    scale = 1.0 / math.sqrt(c["D"])

    def step(q, i, kc, vc, bt, lens, *layers):
        return _MGPU(q, kc, vc, layers[i], bt, lens, scale=scale, config=cfg, **c["scales"])
    n = calls_for(c)
    L = c["L"]
    args = [(c["q"], c["kc"], c["vc"], c["bt"], c["lens"],
             *[jnp.int32((r * n + i) % L) for i in range(n)]) for r in range(L)]
    return chain(step, n), args


def emit(kind: str, **kw) -> None:
    print(f"{kind} " + json.dumps(kw), flush=True)


def child(names: list[str], deadline: float, repeats: int, smoke: bool = False,
          diag: bool = True, check_limit: float = CHECK_LIMIT) -> None:
    """Check then time each named variant at each shape; one line per event on stdout.
    ``smoke``: tiny shapes in the Mosaic GPU interpreter, checks only (CPU); ``diag``: the
    first failing check queues :data:`DIAGNOSTIC` next."""
    table = {n: (kv, kw) for n, kv, kw in [*VARIANTS, DIAGNOSTIC]}
    interp = {"interpret": True} if smoke else {}
    cases: dict[tuple, tuple] = {}  # (B, ctx, kv) -> (case, dirty args, reference output)
    names = list(names)
    diag = diag and DIAGNOSTIC[0] not in names
    while names:
        name = names.pop(0)
        emit("START", name=name)
        kv, kw = table[name]
        dt = F8 if kv == "fp8" else jnp.bfloat16
        cfg = MgpuDecodeConfig(**kw)
        for B, ctx in SMOKE_SHAPES if smoke else SHAPES:
            if time.time() > deadline:
                emit("SKIP", name=name, B=B, ctx=ctx)
                continue
            if (B, ctx, kv) not in cases:
                c = make_case(B, ctx, kv_dtype=dt, tiny=smoke)
                dirty, clean = check_inputs(c)
                ref = jax.jit(functools.partial(paged_decode_attention_ref,
                                                scale=1.0 / math.sqrt(c["D"]),
                                                **c["scales"]))(*clean)
                cases[(B, ctx, kv)] = (c, dirty, ref)
                del clean
            c, dirty, ref = cases[(B, ctx, kv)]
            scale = 1.0 / math.sqrt(c["D"])
            try:  # an exception (not a crash) skips the variant's other shapes
                out = _MGPU(*dirty, scale=scale, config=cfg, **c["scales"], **interp)
                rel, mx = errors(out, ref)
                err = ""
            except Exception as ex:  # noqa: BLE001
                rel = mx = float("inf")
                err = f"{type(ex).__name__}: {str(ex)[:600]}"
            ok = rel < check_limit
            emit("CHECK", name=name, B=B, ctx=ctx, rel_err=rel, max_abs_err=mx, ok=ok,
                 error=err)
            if not ok and diag:
                names.insert(0, DIAGNOSTIC[0])
                diag = False
            if err:
                break
            del out
            if not ok or smoke:
                continue
            run, a = mgpu_runner(c, cfg)
            try:
                t = time_fn(run, a, repeats) / calls_for(c)
            except Exception as ex:  # noqa: BLE001
                emit("CHECK", name=name, B=B, ctx=ctx, rel_err=rel, max_abs_err=mx,
                     ok=False, error=f"timing: {type(ex).__name__}: {str(ex)[:600]}")
                break
            emit("TIME", name=name, B=B, ctx=ctx, us=t * 1e6,
                 gbs=c["kv_bytes_per_call"] / t / 1e9, kv=kv, tune=kw,
                 kv_bytes_per_call=c["kv_bytes_per_call"], layers=c["L"],
                 calls_per_run=calls_for(c))
            del run, a


def run_children(names: list[str], deadline: float, repeats: int, on_line,
                 smoke: bool = False, idle_s: float = 45.0,
                 check_limit: float = CHECK_LIMIT) -> None:
    """Runs ``child`` in subprocesses, reading its lines as they come; a child that dies, or
    prints nothing for ``idle_s`` (a hung kernel), or runs ``15 s`` past the deadline, is
    killed and loses the variant it was on; the next child resumes after it."""
    todo = list(names)
    diag_seen = False
    while todo and time.time() < deadline:
        cmd = [sys.executable, os.path.abspath(__file__), "--child", ",".join(todo),
               "--deadline-at", str(deadline), "--repeats", str(repeats)]
        cmd += ["--smoke"] if smoke else []
        cmd += ["--no-diag"] if diag_seen else []
        cmd += ["--check-limit", str(check_limit)]
        started: list[str] = []
        with tempfile.TemporaryFile("w+") as errf:
            root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(
                [root, *filter(None, [os.environ.get("PYTHONPATH")])]))
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=errf, text=True,
                                    env=env)
            last, killed = time.time(), False
            while True:
                ready, _, _ = select.select([proc.stdout], [], [], 1.0)
                if ready:
                    line = proc.stdout.readline()
                    if not line:
                        break
                    last = time.time()
                    kind, _, rest = line.strip().partition(" ")
                    if kind == "START":
                        started.append(json.loads(rest)["name"])
                        diag_seen = diag_seen or started[-1] == DIAGNOSTIC[0]
                    if kind in ("START", "CHECK", "TIME", "SKIP"):
                        on_line(kind, json.loads(rest))
                elif time.time() - last > idle_s or time.time() > deadline + 15:
                    proc.kill()
                    killed = True
                    break
            rc = proc.wait()
            errf.seek(0)
            err = errf.read() + (f"\nkilled: no output for {idle_s:.0f} s or past the "
                                 "deadline (hung kernel?)" if killed else "")
        if rc == 0 and not killed:
            return
        lost = started[-1] if started else todo[0]
        log(f"child rc {rc} on {lost}: {err[-800:]}")
        on_line("DIED", {"name": lost, "rc": rc, "stderr_tail": err[-800:]})
        todo = [n for n in todo if n not in {*started, lost}]
        if not diag_seen and lost != DIAGNOSTIC[0]:
            todo = [DIAGNOSTIC[0], *todo]


def main(argv: list[str] | None = None) -> None:
    global T0
    T0 = time.time()  # deadlines and log stamps count from this run, not the import
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", ""))
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--deadline-s", type=float, default=95.0,
                   help="start no check or timing past this many seconds")
    p.add_argument("--variants", default="", help="comma list of names (default: all)")
    p.add_argument("--smoke", action="store_true",
                   help="CPU: tiny shapes, Mosaic interpreter, checks only, no Triton")
    p.add_argument("--child", default="", help=argparse.SUPPRESS)
    p.add_argument("--no-diag", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--check-limit", type=float, default=CHECK_LIMIT,
                   help="rel. L2 error a check must stay below (testing the failure path)")
    p.add_argument("--deadline-at", type=float, default=0.0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child(args.child.split(","), args.deadline_at, args.repeats, args.smoke,
                     not args.no_diag, args.check_limit)
    deadline = T0 + args.deadline_s
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    records = RunRecords(os.path.relpath(sys.argv[0]), args.out or None,
                         "results_decode_mgpu.json")
    log("devices", jax.devices(), "jax", jax.__version__)
    rows: dict[tuple, dict] = {}  # (B, ctx) -> {impl: (us, GB/s, err)}
    base: dict[tuple, float] = {}

    # 1. Triton defaults (bf16, FP8 by batch): safe, in this process
    for B, ctx in [] if args.smoke else SHAPES:
        for kv, dt in (("bf16", jnp.bfloat16), ("fp8", F8)):
            name = f"triton_{kv}_default"
            try:
                c = make_case(B, ctx, kv_dtype=dt)
                tune = {"fp8_variant": "by_batch"} if kv == "fp8" else {}
                run, a = ours_runner(c, **tune)
                t = time_fn(run, a, args.repeats) / calls_for(c)
            except Exception as ex:  # noqa: BLE001  keep going: ratios become nan
                log(f"FAILED {name} B{B} ctx{ctx}: {type(ex).__name__}: {str(ex)[:300]}")
                continue
            if kv == "bf16":
                base[(B, ctx)] = t
            gbs = c["kv_bytes_per_call"] / t / 1e9
            r_bf = t / base[(B, ctx)] if (B, ctx) in base else float("nan")
            rows.setdefault((B, ctx), {})[name] = (t * 1e6, gbs, r_bf, float("nan"))
            records.add(f"decode_mgpu/{name}/B{B}_ctx{ctx}", gbs, "GB/s",
                        {"B": B, "ctx": ctx, "kv": kv, "time_us": t * 1e6,
                         "time_over_bf16": r_bf, "kv_bytes_per_call": c["kv_bytes_per_call"],
                         "layers": c["L"], "calls_per_run": calls_for(c), **tune})
            log(f"B{B} ctx{ctx} {name:22s} {t * 1e6:8.1f} us {gbs:7.0f} GB/s t/bf16 {r_bf:.3f}")
            del run, a

    # 2. Mosaic variants in children
    errs: dict[tuple, float] = {}

    def on_line(kind: str, d: dict) -> None:
        n = d["name"]
        if kind == "CHECK":
            errs[(n, d["B"], d["ctx"])] = d["rel_err"]
            records.add(f"decode_mgpu/check_rel_err/{n}/B{d['B']}_ctx{d['ctx']}",
                        d["rel_err"], "rel_l2", d)
            log(f"check {n} B{d['B']} ctx{d['ctx']}: rel {d['rel_err']:.2e} max abs "
                f"{d['max_abs_err']:.2e} {'OK' if d['ok'] else 'BAD: not timed'} "
                f"{d.get('error', '')}")
        elif kind == "TIME":
            key = (d["B"], d["ctx"])
            r_bf = d["us"] / 1e6 / base[key] if key in base else float("nan")
            rows.setdefault(key, {})[n] = (d["us"], d["gbs"], r_bf, errs.get((n, *key)))
            records.add(f"decode_mgpu/{n}/B{d['B']}_ctx{d['ctx']}", d["gbs"], "GB/s",
                        dict(d, time_over_bf16=r_bf, check_rel_err=errs.get((n, *key))))
            log(f"B{d['B']} ctx{d['ctx']} {n:22s} {d['us']:8.1f} us {d['gbs']:7.0f} GB/s "
                f"t/bf16 {r_bf:.3f}")
        elif kind == "DIED":
            records.add(f"decode_mgpu/died/{n}", d["rc"], "rc", d)
        elif kind == "SKIP":
            log(f"deadline: skipped {n} B{d['B']} ctx{d['ctx']}")

    names = [n for n, _, _ in VARIANTS]
    if args.variants:
        names = [n for n in names if n in args.variants.split(",")]
    run_children(names, deadline, args.repeats, on_line, args.smoke,
                 check_limit=args.check_limit)

    # 3. table
    print(f"\nPaged decode on {jax.devices()[0].device_kind} (Hq32/Hkv8/D128/ps16; GB/s of KV "
          f"bytes; t/bf16: time over the bf16 Triton default, target <= 0.5 for FP8)")
    print(f"{'shape':13s} {'impl':22s} {'us':>8s} {'GB/s':>7s} {'t/bf16':>7s} {'err':>8s}")
    for B, ctx in SHAPES:
        for n, (us, gbs, r, e) in sorted(rows.get((B, ctx), {}).items(), key=lambda x: x[1][0]):
            es = "-" if e is None or math.isnan(e) else f"{e:.1e}"
            print(f"B{B} ctx{ctx:<7d} {n:22s} {us:8.1f} {gbs:7.0f} {r:7.3f} {es:>8s}")
    log("done")


if __name__ == "__main__":
    try:
        main()
    except Exception:
        traceback.print_exc()
        raise
