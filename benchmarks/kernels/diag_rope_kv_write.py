"""Where the RoPE + KV write kernel and XLA's path disagree on a GPU (session 28, call 1 of
check_rope_kv_write.py: q values far apart at the Gemma 3 point and the split-K points with an
FP8 cache; about 3 % of FP8 K values one step apart everywhere).

Part 1, FP8 rounding: every finite bf16 value within ±448 (and twice it, as a cache scale of
0.5 makes it) converted float32 -> float8_e4m3fn by XLA on the GPU, by a Pallas (Triton)
kernel and by ml_dtypes on the host (round to nearest, ties to even): counts of values each
rounds differently from the host.

Part 2, q: for each failing point, q from the kernel (Triton), the kernel in Pallas
interpret mode on the same device, XLA's reference on the GPU and the reference on the CPU;
pairwise (largest distance in representable values, fraction differing), which heads and
columns differ, and a few values. Also the kernel at a small page pool (is it the cache's
size?).

    PYTHONPATH=. python3 benchmarks/kernels/diag_rope_kv_write.py --out $OUT/diag
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402

from benchmarks.kernels.check_rope_kv_write import (  # noqa: E402
    F8,
    GRID,
    point_inputs,
    reference,
    rotated_qkv,
    steps_apart,
)
from pallas_kernels.paged_attention.rope_kv_write import rope_write_kv_pallas  # noqa: E402


def fp8_rounding() -> dict:
    bits = np.arange(1 << 16, dtype=np.uint16).view(ml_dtypes.bfloat16).astype(np.float32)
    x = bits[np.isfinite(bits) & (np.abs(bits) <= 224)] * 2  # as a 0.5 scale divides
    host = x.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    xd = jnp.asarray(x)
    xla = np.asarray(jax.jit(lambda v: v.astype(F8))(xd)).view(np.uint8)

    def kern(x_ref, o_ref):
        o_ref[...] = x_ref[...].astype(F8)
    n = x.size
    pad = (-n) % 1024
    xp = jnp.pad(xd, (0, pad)).reshape(-1, 1024)
    tri = np.asarray(pl.pallas_call(
        kern, out_shape=jax.ShapeDtypeStruct(xp.shape, F8), grid=(xp.shape[0],),
        in_specs=[pl.BlockSpec((1, 1024), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((1, 1024), lambda i: (i, 0)),
        interpret=jax.default_backend() == "cpu")(xp)).reshape(-1)[:n].view(np.uint8)
    out = {"values": int(n)}
    for name, got in (("xla", xla), ("pallas_triton", tri)):
        bad = np.nonzero(got != host)[0]
        out[name + "_differ"] = int(bad.size)
        out[name + "_examples"] = [
            (float(x[i]), float(host[i:i + 1].view(ml_dtypes.float8_e4m3fn)[0]),
             float(got[i:i + 1].view(ml_dtypes.float8_e4m3fn)[0])) for i in bad[:6]]
    print("fp8 rounding (value, host RNE, got):", json.dumps(out), flush=True)
    return out


def compare(a, b) -> dict:
    s, f = steps_apart(a, b)
    return {"max_steps": s, "frac": round(f, 5)}


def q_point(name, dtype, pages, layers) -> dict:
    _, T, Hq, Hkv, D, extra = next(g for g in GRID if g[0] == name)
    qkv, cos, sin, slots, scales, kw, kc, vc = point_inputs(
        T, Hq, Hkv, D, extra, dtype, layers, pages)
    layer = jnp.int32(layers // 2)
    qs = {}
    on_cpu_only = jax.default_backend() == "cpu"
    for label, interp in (("triton", on_cpu_only), ("interpret", True)):
        fn = functools.partial(rope_write_kv_pallas, interpret=interp, **kw)
        qs[label] = jax.jit(fn, static_argnums=7)(kc, vc, layer, qkv, cos, sin, slots, Hq,
                                                  *scales)[0]
    qs["xla"] = jax.jit(functools.partial(reference, **kw), static_argnums=7)(
        kc, vc, layer, qkv, cos, sin, slots, Hq, *scales)[0]
    def q_only(*a, **k):  # the reference's q without the caches (CPU: no 4 GB pools)
        return rotated_qkv(*a, **k)[0]
    qs["xla_q_only"] = jax.jit(functools.partial(q_only, **kw), static_argnums=(3, 4, 5))(
        qkv, cos, sin, Hq, Hkv, D)
    cpu = jax.devices("cpu")[0]
    on_cpu = jax.tree.map(lambda a: jax.device_put(a, cpu), (qkv, cos, sin, kw))
    with jax.default_device(cpu):
        qs["cpu_q_only"] = jax.jit(functools.partial(q_only, **on_cpu[3]),
                                   static_argnums=(3, 4, 5))(*on_cpu[:3], Hq, Hkv, D)
    qs = {k: jax.device_put(v, jax.devices()[0]) for k, v in qs.items()}
    base = qs["cpu_q_only"]
    out = {"point": name, "kv": jnp.dtype(dtype).name, "pages": pages}
    for k, v in qs.items():
        out[k + "_vs_cpu"] = compare(v, base)
    out["triton_vs_xla"] = compare(qs["triton"], qs["xla"])
    d = np.asarray(qs["triton"].astype(jnp.float32)) != np.asarray(base.astype(jnp.float32))
    out["differ_by_head"] = d.mean(axis=(0, 2)).round(3).tolist()
    out["differ_by_token"] = d.mean(axis=(1, 2)).round(3).tolist()[:16]
    out["differ_by_column_block32"] = d.reshape(T, Hq, D // 32, 32).mean(
        axis=(0, 1, 3)).round(3).tolist()
    idx = np.argwhere(d)[:5]
    out["examples"] = [(tuple(int(i) for i in ix),
                        float(np.asarray(qs["triton"][tuple(ix)], np.float32)),
                        float(np.asarray(base[tuple(ix)], np.float32)),
                        float(np.asarray(qs["xla"][tuple(ix)], np.float32))) for ix in idx]
    print(json.dumps(out), flush=True)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="")
    p.add_argument("--pages", type=int, nargs="+", default=[4096, 160])
    args = p.parse_args(argv)
    res = {"device": jax.devices()[0].device_kind, "fp8": fp8_rounding(), "q": []}
    for name, dtype in (("g270_b32", jnp.bfloat16), ("8b_b1_sk2", F8),
                        ("8b_b1_sk2", jnp.bfloat16), ("smol_b8_sk2", F8)):
        for pages in args.pages:
            res["q"].append(q_point(name, dtype, pages, 32))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, "diag_rope_kv_write.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
