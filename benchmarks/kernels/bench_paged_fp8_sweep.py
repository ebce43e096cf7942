"""FP8-KV paged decode: one GPU sweep of layouts and launch configs against bf16's default.

The FP8 kernel read 2.2-3.1 TB/s where bf16 reads 3.3-4.2 (session 5, bench_paged_fp8.py).
A Triton 3.6 compile for sm_90 on the CPU machine (NOTES_paged_attention.md, "FP8 KV: static
analysis") shows why: 2.5x the SASS instructions per step of the same bytes and 247
registers (2 programs an SM). This sweep times what the static analysis favours
(``layout="kq"`` with 8 group rows, the staged V, 32-256-token steps, 2/4/8 warps, stages
3 or 5, more split-K programs at B=1) next to the current ``cvt`` default, in one process:

0. one config of each kernel class (cache dtype, layout, group rows, V path) is compiled and
   run in a child process first, so a compiler crash (an abort: the N = 8 dot of ``kq8`` is
   new to XLA's Triton) drops that class instead of the run (``--no-preflight``: skip);
1. every config is checked against the jnp reference on this GPU first (B8 ctx2048, ragged
   lengths incl. 1, a page boundary and the full context); one that fails to compile or to
   match is not timed;
2. the bf16 kernel's default is timed at each shape, then each config at its shapes
   (Llama-3.1-8B heads: Hq 32, Hkv 8, D 128, page 16), configs in priority order, until
   ``--deadline-s`` (the table and JSON still come out);
3. a table last: µs per call, GB/s of KV bytes, time over bf16's (0.5 = FP8 at bf16's GB/s)
   and over ``cvt``'s, per shape fastest first; records in ``--out/results_fp8_sweep.json``.

    PYTHONPATH=. python3 benchmarks/kernels/bench_paged_fp8_sweep.py --out $OUT   # H200
    PYTHONPATH=. python benchmarks/kernels/bench_paged_fp8_sweep.py --smoke       # CPU

Compiles about 100 kernels; built for < 240 s on an H200 (deadline 200 s by default). The
winner becomes a named entry of ``fp8.FP8_DECODE_VARIANTS`` (most already are) and the
default by changing ``fp8.FP8_DECODE_DEFAULT``.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import traceback
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.kernels.bench_paged_attention import calls_for, make_case, ours_runner
from benchmarks.kernels.kernel_bench import RunRecords, rel_err, time_fn
from pallas_kernels.paged_attention import paged_decode_attention, paged_decode_attention_ref
from pallas_kernels.paged_attention.fp8 import FP8_DECODE_VARIANTS as V

warnings.filterwarnings("ignore")
T0 = time.time()
F8 = jnp.float8_e4m3fn
SHAPES = [(32, 2048), (1, 32768), (128, 1024), (128, 2048)]
B1, B32 = [(1, 32768)], [(32, 2048)]
CHECK_LIMIT = 2e-2  # cvt: 3.4e-4 on the H200 (session 5)


def cfg(layout: str = "qk", rows: int | None = None, vs: bool = False, bt: int = 128,
        w: int = 4, st: int = 5, tp: int | None = None, kv: str = "fp8") -> dict:
    """Kernel keyword arguments of one sweep point (``kv``: "fp8" or "bf16" cache). Options
    left out take the plain defaults (``fp8_variant="cvt"`` fills nothing), not those of the
    batch's default variant."""
    kw = {"layout": layout, "block_tokens": bt, "num_warps": w, "num_stages": st, "kv": kv,
          "fp8_variant": "cvt"}
    if rows:
        kw["group_rows"] = rows
    if vs:
        kw["fp8_v_stage"] = True
    if tp:
        kw["target_programs"] = tp
    return kw


def kq8(**kw) -> dict:
    return cfg("kq", 8, True, **kw)


def named(name: str) -> dict:
    """A :data:`fp8.FP8_DECODE_VARIANTS` entry as a sweep config (the winner's name is then
    the one-line default switch, ``fp8.FP8_DECODE_DEFAULT``)."""
    return dict(V[name], kv="fp8", fp8_variant="cvt")


# (name, kernel kwargs, shapes or None = all), most promising first: the deadline drops the
# tail. Registers / shared memory / programs an SM / SASS per step from the static analysis
# (Triton 3.6, sm_90, B32 ctx2048); names in the variant table take its entry.
CONFIGS: list[tuple[str, dict, list | None]] = [
    ("by_batch", {"kv": "fp8"}, None),  # what the engine runs: fp8.variant_for_batch's pick
    ("cvt", named("cvt"), None),  # current default: 247 regs, 2/SM, 1196 per 128 tokens
    # session 13: both dots FP8 on wgmma (fp8_fast_accum), group padded to 16 rows
    ("kq8w_bt64", named("kq8w_bt64"), None),  # 87 regs, 36 KB, 5/SM, 551 per 64, no cvt
    # session 15: only K q8ᵀ in FP8 (wgmma), V widened (f16 wgmma); H200: slower than kq8
    ("kq8k_bt64", named("kq8k_bt64"), None),
    ("kq8k", named("kq8k"), None),
    ("kq8w", named("kq8w"), None),  # 128 tokens: 121 regs, 69 KB, 3/SM, 828
    ("kq8_bt64_w2", named("kq8_bt64_w2"), None),  # the B >= 64 default since session 6
    ("kq8", named("kq8"), None),  # 128 tokens: 194 regs, 101 KB, 2/SM, 805
    ("kq8_bt64", named("kq8_bt64"), None),  # 116 regs, 51 KB, 4/SM, 521 per 64
    ("kq8_bt128_s3", named("kq8_bt128_s3"), None),  # one buffer: 157 regs, 68 KB, 3/SM, 770
    ("vstage", named("vstage"), None),  # qk layout, staged V: 164 regs, 105 KB, 2/SM, 1061
    ("kq8_bt64_w8", named("kq8_bt64_w8"), None),  # 80 regs, 51 KB, 3/SM, 363 a warp
    ("kq8_bt128_w8_s3", kq8(w=8, st=3), None),  # 112 regs, 68 KB, 2/SM, 486 a warp
    ("kq16", named("kq16"), None),  # wgmma 64x16x16 (no N = 8 dot), 227 regs, 1035
    ("kq8_bt64_s3", kq8(bt=64, st=3), None),  # 110 regs, 35 KB, 4/SM, 482
    ("kq8_bt32", named("kq8_bt32"), None),  # 80 regs, 26 KB, 6/SM, 351 per 32
    ("kq8_bt64_tp512", named("kq8_bt64_tp512"), B32 + B1),  # B32: 2 splits, 4/SM
    ("kq8_bt32_tp792", kq8(bt=32, tp=792), B32 + B1),  # 6/SM worth of programs
    ("kq8_bt64_w8_tp396", kq8(bt=64, w=8, tp=396), B32 + B1),
    ("kq8_bt128_tp132", kq8(tp=132), B1),  # B=1 ctx 32k: fewer, longer splits
    ("kq8_bt128_tp528", kq8(tp=528), B1),
    ("kq8_bt64_tp1056", kq8(bt=64, tp=1056), B1),
    ("kq8_bt32_tp1056", kq8(bt=32, tp=1056), B1),
    ("cvt_tp528", {"kv": "fp8", "target_programs": 528, "fp8_variant": "cvt"}, B1),
    ("kq8_bt128_s4", kq8(st=4), B32 + [(128, 2048)]),  # = s3 in Triton 3.6; XLA's?
    ("kq8_bt64_w2", kq8(bt=64, w=2), None),  # 194 regs, 4/SM, 791 a warp
    ("kq8_bt256_w8_s3", kq8(bt=256, w=8, st=3), None),  # 161 regs, 135 KB, 1/SM, 773
    ("vstage_bt64", cfg(vs=True, bt=64), None),  # 142 regs, 54 KB, 3/SM, 636
    ("kq16_bt64", cfg("kq", 16, True, bt=64), None),  # 139 regs, 54 KB, 3/SM, 670
    ("bf16_kq8_bt64", cfg("kq", 8, bt=64, kv="bf16"), None),  # bf16 for comparison
    # session 32: one warp a program -- the kq layout's softmax reductions run over the
    # token (M) axis, across warps (shared memory and a barrier each step) with 2+ warps,
    # inside one warp (shuffles) with one; more programs an SM make up the parallelism.
    ("kq8_bt64_w1", kq8(bt=64, w=1), None),
    ("kq8_bt32_w1_tp1056", kq8(bt=32, w=1, tp=1056), None),
]


def log(*a) -> None:
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def split_kv(kw: dict) -> tuple[jnp.dtype, dict]:
    kw = dict(kw)
    return (F8 if kw.pop("kv") == "fp8" else jnp.bfloat16), kw


def ragged_lens(c) -> jax.Array:
    """Random lengths in [1, ctx] with 1, three pages and the full context among them."""
    lens = np.random.default_rng(1).integers(1, c["ctx"] + 1, c["B"])
    lens[0], lens[-1], lens[len(lens) // 2] = 1, c["ctx"], 3 * c["ps"]
    return jnp.asarray(lens, jnp.int32)


def check_case(c) -> tuple[tuple, jax.Array]:
    """(arguments, reference output) of the correctness check at case ``c``, last layer."""
    a = (c["q"], c["kc"], c["vc"], jnp.int32(c["L"] - 1), c["bt"], ragged_lens(c))
    scale = 1.0 / math.sqrt(c["D"])
    ref = jax.jit(lambda *x: paged_decode_attention_ref(*x, scale=scale, **c["scales"]))(*a)
    return a, ref


def check(c, a, ref, **tune) -> float:
    scale = 1.0 / math.sqrt(c["D"])
    o = jax.jit(lambda *x: paged_decode_attention(*x, scale=scale, **c["scales"], **tune))(*a)
    return rel_err(o, ref)


def kernel_class(kw: dict) -> tuple:
    """What decides the kernel's code shape beyond sizes: cache dtype, layout, rows, V path."""
    return (kw["kv"], kw.get("layout", "qk"), kw.get("group_rows"), kw.get("fp8_v_stage", False))


PREFLIGHT = """
import sys, jax, jax.numpy as jnp
from benchmarks.kernels.bench_paged_attention import make_case
from benchmarks.kernels.bench_paged_fp8_sweep import CONFIGS, kernel_class, split_kv
from pallas_kernels.paged_attention import paged_decode_attention
for want in sys.argv[1:]:
    name, kw, _ = next(c for c in CONFIGS if str(kernel_class(c[1])) == want)
    dt, tune = split_kv(kw)
    c = make_case(8, 256, kv_dtype=dt, L=2, tiny=True)
    try:
        jax.block_until_ready(paged_decode_attention(c["q"], c["kc"], c["vc"], 1, c["bt"],
                              c["lens"], scale=0.1, **c["scales"], **tune))
        print("PREFLIGHT OK", want, flush=True)
    except Exception as ex:  # an exception is handled in the sweep itself
        print("PREFLIGHT EXC", want, type(ex).__name__, flush=True)
"""


def preflight(configs: list) -> set:
    """Compile and run one config of each kernel class in child processes, so that a
    compiler crash (an abort, not an exception) costs that class, not the whole run.
    Returns the classes whose child died."""
    import subprocess
    todo = list(dict.fromkeys(str(kernel_class(kw)) for _, kw, _ in configs))
    crashed: set = set()
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    while todo:
        try:
            r = subprocess.run([sys.executable, "-c", PREFLIGHT, *todo], check=False,
                               capture_output=True, text=True, env=env, timeout=90)
        except subprocess.TimeoutExpired:
            log("preflight: timed out; going on without it")
            break
        log(f"preflight rc {r.returncode}: {r.stdout.strip()}")
        if r.returncode == 0:
            break
        n_done = sum(ln.startswith("PREFLIGHT ") for ln in r.stdout.splitlines())
        if n_done >= len(todo):
            break
        crashed.add(todo[n_done])
        log(f"preflight: the child died on {todo[n_done]}: {r.stderr[-600:]}")
        todo = todo[n_done + 1:]
    return crashed


def parse_shapes(spec: str) -> list[tuple[int, int]]:
    """``"512x1536,128x2048"`` -> [(512, 1536), (128, 2048)] (batch, context tokens).

    Raises:
      ValueError: an entry that is not two positive integers joined by "x"."""
    out = []
    for sh in spec.split(","):
        parts = sh.strip().split("x")
        if len(parts) != 2 or not all(v.isdigit() and int(v) > 0 for v in parts):
            raise ValueError(f"--shapes {spec!r}: {sh!r} is not BxCTX (e.g. 512x1536)")
        out.append((int(parts[0]), int(parts[1])))
    return out


def main(argv: list[str] | None = None) -> None:
    global T0
    T0 = time.time()  # deadlines and log stamps count from this run, not the import
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", ""))
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--deadline-s", type=float, default=200.0,
                   help="start no timing past this many seconds (the table still prints)")
    p.add_argument("--configs", default="", help="comma list of names (default: all)")
    p.add_argument("--smoke", "--cpu-smoke", dest="smoke", action="store_true",
                   help="tiny shapes, interpret mode (CPU)")
    p.add_argument("--page-size", type=int, default=16,
                   help="tokens per KV page of every case, bf16's baseline included")
    p.add_argument("--shapes", default="",
                   help="comma list of BxCTX (e.g. 512x1536: the 1000 / 1000 x 512 run's "
                        "steady state) instead of the default grid; configs made for given "
                        "shapes only (split counts at B1 / B32) are left out")
    p.add_argument("--no-preflight", action="store_true",
                   help="skip compiling one config of each kernel class in a child first")
    args = p.parse_args(argv)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    records = RunRecords(os.path.relpath(sys.argv[0]), args.out or None,
                         "results_fp8_sweep.json")
    configs = CONFIGS
    if args.configs:
        keep = args.configs.split(",")
        configs = [c for c in CONFIGS if c[0] in keep]
    interp = {"interpret": True} if args.smoke else {}
    shapes = [(2, 128), (1, 256)] if args.smoke else SHAPES
    if args.shapes:
        try:
            shapes = parse_shapes(args.shapes)
        except ValueError as e:
            p.error(str(e))
        configs = [c for c in configs if c[2] is None]
    if args.smoke:
        configs = [(n, kw, None) for n, kw, _ in configs]
    if not (args.smoke or args.no_preflight):  # before this process takes the GPU
        crashed = preflight(configs)
        for name, kw, _ in configs:
            if str(kernel_class(kw)) in crashed:
                records.add(f"paged_decode_fp8_sweep/check_rel_err/{name}", float("nan"),
                            "rel_l2", {"config": name, "ok": False, "crash": True})
        configs = [c for c in configs if str(kernel_class(c[1])) not in crashed]
    log("devices", jax.devices(), "jax", jax.__version__, "configs", len(configs))

    # 1. bf16 default per shape (the ratio's denominator); FP8 / bf16 cases kept for reuse
    cases: dict[tuple, dict] = {}
    base: dict[tuple, float] = {}
    base_gbs: dict[tuple, float] = {}
    for B, ctx in shapes:
        c = make_case(B, ctx, ps=args.page_size, kv_dtype=jnp.bfloat16, tiny=args.smoke)
        try:
            run, a = ours_runner(c, **interp)
            base[(B, ctx)] = time_fn(run, a, 1 if args.smoke else args.repeats) / calls_for(c)
            t = base[(B, ctx)]
            gbs = base_gbs[(B, ctx)] = c["kv_bytes_per_call"] / t / 1e9
            records.add(f"paged_decode_fp8_sweep/bf16_default/B{B}_ctx{ctx}", gbs, "GB/s",
                        {"B": B, "ctx": ctx, "kv_dtype": "bfloat16", "time_us": t * 1e6,
                         "config": "bf16_default", "tune": "{}",
                         "page": args.page_size})
            log(f"B{B} ctx{ctx} bf16 default {t * 1e6:8.1f} us {gbs:7.0f} GB/s")
        except Exception as ex:  # noqa: BLE001  keep going: ratios become nan
            log(f"FAILED bf16 B{B} ctx{ctx}: {type(ex).__name__}: {str(ex)[:300]}")
        del c
    rows = []  # (shape, name, us, GB/s, t/bf16, t/cvt, err)
    cvt_t: dict[tuple, float] = {}
    ck = {"B": 2, "ctx": 128} if args.smoke else {"B": 8, "ctx": 2048}
    ck_cases = {}
    for dt in (F8, jnp.bfloat16):
        c = make_case(**ck, ps=args.page_size, kv_dtype=dt, L=2, tiny=args.smoke)
        ck_cases[dt] = (c, *check_case(c))

    # 2. each config: check on this device, then time at its shapes
    for name, kw, cshapes in configs:
        if time.time() - T0 > args.deadline_s:
            log("deadline: skipping", name)
            continue
        dt, tune = split_kv(kw)
        try:
            err = check(*ck_cases[dt], **interp, **tune)
        except Exception as ex:  # noqa: BLE001  one failing config must not lose the run
            err = float("nan")
            log(f"check FAILED {name}: {type(ex).__name__}: {str(ex)[:400]}")
        ok = err < CHECK_LIMIT
        records.add(f"paged_decode_fp8_sweep/check_rel_err/{name}", err, "rel_l2",
                    dict(ck, kv_dtype=str(jnp.dtype(dt)), config=name, tune=str(tune), ok=ok,
                         page=args.page_size))
        log(f"check {name}: rel err {err:.2e} {'OK' if ok else 'BAD: not timed'}")
        if not ok:
            continue
        for B, ctx in (cshapes or shapes):
            if time.time() - T0 > args.deadline_s:
                log("deadline: skipping", name, B, ctx)
                continue
            key = (B, ctx, str(jnp.dtype(dt)))
            if key not in cases:
                cases[key] = make_case(B, ctx, ps=args.page_size, kv_dtype=dt,
                                       tiny=args.smoke)
            c = cases[key]
            try:
                run, a = ours_runner(c, **interp, **tune)
                t = time_fn(run, a, 1 if args.smoke else args.repeats) / calls_for(c)
            except Exception as ex:  # noqa: BLE001
                log(f"FAILED {name} B{B} ctx{ctx}: {type(ex).__name__}: {str(ex)[:300]}")
                continue
            if name == "cvt":
                cvt_t[(B, ctx)] = t
            gbs = c["kv_bytes_per_call"] / t / 1e9
            r_bf = t / base[(B, ctx)] if (B, ctx) in base else float("nan")
            r_cvt = (t / cvt_t[(B, ctx)] if (B, ctx) in cvt_t and dt == F8
                     else float("nan"))
            records.add(f"paged_decode_fp8_sweep/{name}/B{B}_ctx{ctx}", gbs, "GB/s",
                        {"B": B, "ctx": ctx, "Hq": c["Hq"], "Hkv": c["Hkv"], "D": c["D"],
                         "page": c["ps"], "kv_dtype": str(jnp.dtype(dt)), "config": name,
                         "tune": str(tune), "time_us": t * 1e6, "time_over_bf16": r_bf,
                         "time_over_cvt": r_cvt, "kv_bytes_per_call": c["kv_bytes_per_call"],
                         "layers": c["L"], "calls_per_run": calls_for(c),
                         "check_rel_err": err})
            rows.append(((B, ctx), name, t * 1e6, gbs, r_bf, r_cvt, err))
            log(f"B{B} ctx{ctx} {name:20s} {t * 1e6:8.1f} us {gbs:7.0f} GB/s "
                f"t/bf16 {r_bf:.3f} t/cvt {r_cvt:.3f}")

    # 3. geometric mean of t/bf16 over the configs timed at every shape, then the table
    full = {}
    for name in dict.fromkeys(r[1] for r in rows):
        rs = [r[4] for r in rows if r[1] == name]
        if len(rs) == len(shapes) and not any(math.isnan(x) for x in rs):
            full[name] = math.exp(sum(math.log(x) for x in rs) / len(rs))
            records.add(f"paged_decode_fp8_sweep/geomean_time_over_bf16/{name}", full[name],
                        "ratio", {"config": name, "shapes": str(shapes)})
    print(f"\nFP8-KV decode sweep on {jax.devices()[0].device_kind} "
          f"(Hq32/Hkv8/D128/ps{args.page_size}; "
          f"GB/s of KV bytes; t/bf16: time over bf16's default, 0.5 = bf16's GB/s)")
    print(f"{'shape':13s} {'config':20s} {'us':>8s} {'GB/s':>7s} {'t/bf16':>7s} "
          f"{'t/cvt':>6s} {'err':>8s}")
    for B, ctx in shapes:
        if (B, ctx) in base:
            t = base[(B, ctx)]
            print(f"B{B} ctx{ctx:<7d} {'bf16 default':20s} {t * 1e6:8.1f} "
                  f"{base_gbs[(B, ctx)]:7.0f} {1.0:7.3f}")
        for r in sorted((r for r in rows if r[0] == (B, ctx)), key=lambda r: r[2]):
            print(f"B{B} ctx{ctx:<7d} {r[1]:20s} {r[2]:8.1f} {r[3]:7.0f} {r[4]:7.3f} "
                  f"{r[5]:6.3f} {r[6]:8.1e}")
    print("\ngeomean t/bf16 over all shapes (lower is better):")
    for name, g in sorted(full.items(), key=lambda x: x[1]):
        print(f"  {name:20s} {g:.3f}")


if __name__ == "__main__":
    try:
        main()
    except Exception:
        traceback.print_exc()
        raise
