"""Cost of per-group FP8 weight scales in the engine's W8A16 GEMM (XLA path) vs per-channel.

For each projection shape and token count M, times one jitted
``jaxinfer.quantization.fp8_weight_linear`` (the engine's ``_proj``) with per-channel scales
``[N]`` and with 128-row group scales ``[K/128, N]`` (the layout of block-FP8 checkpoints and
of ``quantize_params_fp8(group_size=128)``) both ways it can run them (one dot per group,
``grouped_dots=True``; dequantize first, ``False``), next to the bf16 GEMM ``x @ w``. Each call runs
R distinct weights (R x FP8 bytes >= 300 MB on a GPU so L2 never holds them); reported:
median wall time per weight over 7 calls, effective weight-read GB/s, and the grouped /
per-channel ratio. One JSON record per (shape, M, variant) via benchmarks/common.py.

    PYTHONPATH=. python3 benchmarks/kernels/bench_fp8_groups.py            # GPU: 8B shapes
    .venv/bin/python benchmarks/kernels/bench_fp8_groups.py --shapes smollm2   # CPU smoke

What to look for: at decode (M <= 16) the faster grouped way within ~1.1x of per-channel
means the group scales are cheap: then set ``DEFAULT_GROUP_SIZE = 128`` in
jaxinfer/quantization.py (KL -25 %, top-1 +1 point on the real models, benchmarks/RESULTS.md)
and ``_GROUPED_DOT_MAX_M`` to where dequantize-first starts winning. Measured on a loaded
2-core CPU (XLA:CPU, not a target): one-dot-per-group 2-4x slower than per-channel at M = 8-16.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.common import record  # noqa: E402
from jaxinfer.quantization import fp8_weight_linear, quantize_fp8_weight  # noqa: E402

SHAPES = {  # name: {projection: (K, N)}
    "8b": {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672),
           "down": (14336, 4096)},
    "smollm2": {"qkv": (576, 960), "gate_up": (576, 3072), "down": (1536, 576)},
}


def _time(fn, *args) -> float:
    jax.block_until_ready(fn(*args))  # compile
    ts = []
    for _ in range(7):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="8b" if jax.default_backend() != "cpu" else "smollm2",
                    choices=list(SHAPES))
    ap.add_argument("--ms", type=lambda s: [int(v) for v in s.split(",")],
                    default=[1, 8, 16, 64, 512])
    ap.add_argument("--group", type=int, default=128)
    ns = ap.parse_args()
    act = jnp.bfloat16 if jax.default_backend() != "cpu" else jnp.float32
    print(f"{'shape':>8} {'M':>5} {'bf16 us':>9} {'chan us':>9} {'dots us':>9} "
          f"{'deq us':>9} {'chan GB/s':>9} {'grp/chan':>8}", flush=True)
    for pname, (K, N) in SHAPES[ns.shapes].items():
        R = max(1, min(8, int(300e6 // (K * N)))) if jax.default_backend() != "cpu" else 1
        keys = jax.random.split(jax.random.key(0), R)
        w = [jax.random.normal(k, (K, N), jnp.float32) / K ** 0.5 for k in keys]
        chan = [quantize_fp8_weight(x) for x in w]
        grp = [quantize_fp8_weight(x, ns.group) for x in w]
        wb = [x.astype(act) for x in w]
        del w

        def fp8(grouped_dots):
            return jax.jit(lambda x, ws: [fp8_weight_linear(x, q, s, grouped_dots=grouped_dots)
                                          for q, s in ws])

        run_fp8, run_dots, run_deq = fp8(None), fp8(True), fp8(False)

        @jax.jit
        def run_bf16(x, ws):
            return [x @ v for v in ws]

        for M in ns.ms:
            x = jax.random.normal(jax.random.key(M), (M, K), jnp.float32).astype(act)
            t = {"bf16": _time(run_bf16, x, wb) / R, "channel": _time(run_fp8, x, chan) / R,
                 "group_dots": _time(run_dots, x, grp) / R,
                 "group_dequant": _time(run_deq, x, grp) / R}
            t["group"] = t["group_dots"] if M <= 16 else t["group_dequant"]  # the dispatch
            cfg = {"shape": f"{ns.shapes}_{pname}", "K": K, "N": N, "M": M,
                   "group_size": ns.group, "activations": jnp.dtype(act).name, "weights": R}
            for variant, sec in t.items():
                record("fp8_group_gemm_us", sec * 1e6, "us", {**cfg, "variant": variant})
            print(f"{pname:>8} {M:>5} {t['bf16'] * 1e6:>9.1f} {t['channel'] * 1e6:>9.1f} "
                  f"{t['group_dots'] * 1e6:>9.1f} {t['group_dequant'] * 1e6:>9.1f} "
                  f"{K * N / t['channel'] / 1e9:>9.1f} {t['group'] / t['channel']:>8.2f}",
                  flush=True)


if __name__ == "__main__":
    main()
