"""FP8-KV paged decode: the kernel's FP8 variants beside the bf16 kernel, on one GPU.

Checks every variant of ``pallas_kernels.paged_attention.fp8.FP8_DECODE_VARIANTS`` (and the
extra launch configs below) against the jnp reference at a ragged-length shape, then
times each at the issue's shapes (FP8 KV, Hq32/Hkv8/D128, page 16) next to the bf16 kernel
in the same process, and prints a table last: µs per call, GB/s of the KV bytes read, and
the time as a fraction of the bf16 kernel's (0.5 = FP8 at bf16's GB/s). Every number is a
JSON record in ``--out/results_fp8.json``. Built for < 150 s on an H200.

    PYTHONPATH=. python3 benchmarks/kernels/bench_paged_fp8.py --out $OUT
    PYTHONPATH=. python3 benchmarks/kernels/bench_paged_attention.py --fp8-sweep --out $OUT
    PYTHONPATH=. python benchmarks/kernels/bench_paged_fp8.py --smoke   # CPU, interpret

Harness (chained calls over rotating layers, median of repeats) and check: the same as
bench_paged_attention.py. Notes: benchmarks/kernels/NOTES_paged_attention.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
import warnings

import jax
import jax.numpy as jnp

from benchmarks.kernels.bench_paged_attention import calls_for, check, make_case, ours_runner
from benchmarks.kernels.kernel_bench import RunRecords, time_fn
from pallas_kernels.paged_attention.fp8 import FP8_DECODE_VARIANTS

warnings.filterwarnings("ignore")
T0 = time.time()
F8 = jnp.float8_e4m3fn
SHAPES = [(32, 2048), (1, 32768), (128, 1024), (128, 2048)]
# Launch configs tried beside the named variants (kernel keyword arguments).
EXTRA = {
    "bits_bt64": {"fp8_widen": "bits", "block_tokens": 64},
    "qk8_bits_tp264": {"fp8_dots": "qk", "fp8_widen": "bits", "target_programs": 264},
}
CHECK_LIMIT = {"cvt": 2e-2, "bits": 2e-2}  # fp8-dot variants: 5e-2 (q / p in e4m3)


def log(*a) -> None:
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def variants(args) -> dict[str, dict]:
    v = dict(FP8_DECODE_VARIANTS, **EXTRA)
    if args.variants:
        v = {k: v[k] for k in args.variants.split(",")}
    return v


def main(argv: list[str] | None = None) -> None:
    global T0
    T0 = time.time()  # deadlines and log stamps count from this run, not the import
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", ""))
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--smoke", "--cpu-smoke", dest="smoke", action="store_true",
                   help="tiny shapes, interpret mode (CPU)")
    p.add_argument("--deadline-s", type=float, default=130.0,
                   help="skip remaining timings past this (the table still prints)")
    p.add_argument("--variants", default="", help="comma list (default: all)")
    p.add_argument("--fp8-sweep", action="store_true", help="accepted (the default mode)")
    args = p.parse_args(argv)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    records = RunRecords(os.path.relpath(sys.argv[0]), args.out or None, "results_fp8.json")
    interp = {"interpret": True} if args.smoke else {}
    shapes = [(2, 128)] if args.smoke else SHAPES
    if args.smoke:
        args.deadline_s = float("inf")
    repeats = 1 if args.smoke else args.repeats
    var = variants(args)
    log("devices", jax.devices(), "jax", jax.__version__, "variants", list(var))

    # 1. correctness on this device: ragged lengths incl. 1, 3 pages and the full context
    errs: dict[str, float] = {}
    ck = dict(B=2, ctx=128) if args.smoke else dict(B=8, ctx=2048)
    c = make_case(**ck, kv_dtype=F8, L=2, tiny=args.smoke)
    for name, kw in var.items():
        for window in (0,):  # the window path is the same code in every variant
            try:
                e = check(c, window=window, **interp, **kw)
            except Exception as ex:  # noqa: BLE001  one failing variant must not lose the run
                e = float("nan")
                log("check FAILED", name, type(ex).__name__, str(ex)[:300])
            ok = e < CHECK_LIMIT.get(name, 5e-2)
            errs[name] = max(errs.get(name, 0.0), e) if e == e else e
            records.add(f"paged_decode_fp8/check_rel_err/{name}", e, "rel_l2",
                        dict(ck, kv_dtype="float8_e4m3fn", window=window, variant=name,
                             tune=str(kw), ok=ok))
            log(f"check {name} window={window}: rel err {e:.2e} {'OK' if ok else 'BAD'}")
    del c

    # 2. timings: bf16 kernel, then each FP8 variant, same harness and shapes
    rows = []
    c = None
    for B, ctx in shapes:
        base_t = None
        for kv in ("bf16", *var):
            if time.time() - T0 > args.deadline_s:
                log("deadline: skipping", B, ctx, kv)
                continue
            dt = jnp.bfloat16 if kv == "bf16" else F8
            if c is None or c["kc"].dtype != dt:
                c = None  # free the bf16 cache before making the fp8 one
                c = make_case(B, ctx, kv_dtype=dt, tiny=args.smoke)
            tune = {} if kv == "bf16" else var[kv]
            try:
                run, a = ours_runner(c, **interp, **tune)
                t = time_fn(run, a, repeats) / calls_for(c)
            except Exception as ex:  # noqa: BLE001
                log(f"FAILED B{B} ctx{ctx} {kv}: {type(ex).__name__}: {str(ex)[:300]}")
                continue
            base_t = t if kv == "bf16" else base_t
            gbs = c["kv_bytes_per_call"] / t / 1e9
            ratio = t / base_t if base_t else float("nan")
            cfg = {"B": B, "ctx": ctx, "Hq": c["Hq"], "Hkv": c["Hkv"], "D": c["D"],
                   "page": c["ps"], "kv_dtype": str(c["kc"].dtype), "variant": kv,
                   "tune": str(tune), "time_us": t * 1e6, "time_over_bf16": ratio,
                   "kv_bytes_per_call": c["kv_bytes_per_call"], "layers": c["L"],
                   "calls_per_run": calls_for(c), "check_rel_err": errs.get(kv)}
            records.add(f"paged_decode_fp8/{kv}/B{B}_ctx{ctx}", gbs, "GB/s", cfg)
            rows.append((f"B{B} ctx{ctx}", kv, t * 1e6, gbs, ratio, errs.get(kv)))
            log(f"B{B} ctx{ctx} {kv:16s} {t * 1e6:8.1f} us {gbs:8.0f} GB/s x{ratio:.3f}")
        c = None

    print(f"\nFP8-KV decode on {jax.devices()[0].device_kind} (Hq32/Hkv8/D128/ps16; "
          f"GB/s of KV bytes; t/bf16: time over the bf16 kernel's, 0.5 = same GB/s)")
    print(f"{'shape':14s} {'variant':16s} {'us':>8s} {'GB/s':>7s} {'t/bf16':>7s} {'err':>8s}")
    for shape, kv, us, gbs, ratio, e in rows:
        es = f"{e:8.1e}" if e is not None else f"{'-':>8s}"
        print(f"{shape:14s} {kv:16s} {us:8.1f} {gbs:7.0f} {ratio:7.3f} {es}")


if __name__ == "__main__":
    try:
        main()
    except Exception:
        traceback.print_exc()
        raise
