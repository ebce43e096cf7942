"""GPU check of row_quant.norm_quant_fp8 and of the engine path that uses it (H200).

1. The kernel against its math, ``quantize_rows_fp8(rms_norm(x.astype(float32), w, eps))``
   (and without the norm), at the Llama-3.1-8B / 70B input widths and decode rows, bf16 x:
   scales' relative error, the share of e4m3 codes that differ (a code at a rounding boundary
   may move one step: rsqrt and the summation order differ from XLA's), and the wall time per
   call; ``codes_differ_bf16_row``: against the normed row rounded to bf16 first (what the
   unfused engine computes where XLA materializes it), for information.
2. A small random Llama-shaped FP8 engine on the Pallas kernels with the fused quantization
   against the same engine without it (``fp8_takes_quantized_x`` forced False: XLA's
   reduction + convert before each GEMM). float32 engines: the same math, greedy tokens must
   be equal (the check). bf16 engines: each path against the float32 engine, and against
   each other (first differing token, logprob difference up to it), reported: the fused path
   keeps the normed row in float32, the unfused one rounds it where XLA materializes it, so a
   near-tie of the random model may flip (session 12, call 1: one of three prompts).

  PYTHONPATH=. python3 benchmarks/kernels/check_row_quant.py --out $OUT/row_quant
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def kernel_rows() -> list[dict]:
    import jax
    import jax.numpy as jnp

    from jaxinfer.layers.norm import rms_norm
    from pallas_kernels.matmul import quantize_rows_fp8
    from pallas_kernels.matmul.row_quant import norm_quant_fp8

    cpu = jax.default_backend() == "cpu"  # interpret mode, 2 timed calls (a smoke run)
    reps = 2 if cpu else 200
    rows = []
    for M in (1, 16, 64):
        for K in (4096, 8192, 14336):
            for norm in (True, False):
                kx, kw = jax.random.split(jax.random.PRNGKey(M * K + norm))
                x = (jax.random.normal(kx, (M, K), jnp.float32) * 3).astype(jnp.bfloat16)
                w = jax.random.normal(kw, (K,), jnp.float32).astype(jnp.bfloat16)
                fn = jax.jit(lambda x, w: norm_quant_fp8(x, w if norm else None, 1e-5,
                                                         interpret=cpu))
                q, s = jax.block_until_ready(fn(x, w))
                ref = jax.jit(lambda x, w: quantize_rows_fp8(
                    rms_norm(x.astype(jnp.float32), w, 1e-5) if norm else x))
                qr, sr = ref(x, w)
                qb = jax.jit(lambda x, w: quantize_rows_fp8(
                    rms_norm(x, w, 1e-5).astype(jnp.float32) if norm else x))(x, w)[0]
                t0 = time.perf_counter()
                for _ in range(reps):
                    r = fn(x, w)
                jax.block_until_ready(r)
                us = 1e6 * (time.perf_counter() - t0) / reps
                qd = np.asarray(q.astype(jnp.float32)) != np.asarray(qr.astype(jnp.float32))
                rows.append({"M": M, "K": K, "norm": norm, "us_per_call": us,
                             "scale_rel_err": float(np.max(np.abs(np.asarray(s) / np.asarray(sr)
                                                                  - 1))),
                             "codes_differ": float(qd.mean()),
                             "codes_differ_bf16_row": float(np.mean(
                                 np.asarray(q.astype(jnp.float32))
                                 != np.asarray(qb.astype(jnp.float32))))})
                print(json.dumps(rows[-1]), flush=True)
    return rows


def _generate(kw: dict, prompts, sp, fused: bool):
    """Outputs of a fresh dummy:rq-llama engine, with the fused norm + quantization kernel
    (``fused``) or with the unfused XLA path (``fp8_takes_quantized_x`` patched off)."""
    import jax

    from jaxinfer import LLM
    from pallas_kernels.matmul import fp8_plan

    real = fp8_plan.fp8_takes_quantized_x
    if not fused:
        fp8_plan.fp8_takes_quantized_x = lambda *a, **k: False
    jax.clear_caches()
    try:
        return LLM("dummy:rq-llama", **kw).generate(prompts, sp)
    finally:
        fp8_plan.fp8_takes_quantized_x = real


def _agreement(got, ref) -> dict:
    """Greedy tokens equal per prompt, first differing position, and the largest |logprob|
    difference of the chosen tokens up to it (the same context on both sides)."""
    same, first, lp = [], [], [0.0]
    for g, r in zip(got, ref):
        a, b = g.outputs[0], r.outputs[0]
        same.append(a.token_ids == b.token_ids)
        n = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y),
                 len(a.token_ids))
        first.append(n)
        lp += [abs(a.logprobs[i][t] - b.logprobs[i][t])
               for i, t in enumerate(a.token_ids[:n + 1]) if t in b.logprobs[i]]
    return {"tokens_equal": same, "first_difference": first, "max_logprob_diff": max(lp)}


def engine_check() -> dict:
    """A small FP8 engine (hidden 512, 4 layers, random weights) on the Pallas kernels,
    with and without the fused kernel. float32: the same math on both paths, so the greedy
    tokens must be equal (the check). bfloat16: the unfused path rounds the normed row (or
    XLA keeps it in float32 where it fuses) differently from the kernel's float32 row, so
    near-ties may flip; each path is compared with the float32 engine instead (reported)."""
    from jaxinfer import SamplingParams
    from jaxinfer.loading.dummy import DUMMY_CONFIGS

    DUMMY_CONFIGS["rq-llama"] = dataclasses.replace(
        DUMMY_CONFIGS["tiny-llama"], hidden_size=512, intermediate_size=1792, num_heads=8,
        num_kv_heads=2, head_dim=64, num_layers=4, vocab_size=512, layer_types=None,
        name="dummy:rq-llama")
    kw = dict(quantization="fp8", matmul_backend="pallas", max_model_len=256,
              max_num_seqs=4, decode_buckets=(4,), prefill_buckets=(128,),
              max_num_batched_tokens=128, num_kv_pages=64)
    prompts = [[5, 6, 7], list(range(10, 60)), [9] * 17]
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=1)
    out = {}
    for dtype in ("float32", "bfloat16"):
        for fused in (True, False):
            out[dtype, fused] = _generate({**kw, "dtype": dtype}, prompts, sp, fused)
    return {"float32_fused_vs_unfused": _agreement(out["float32", True], out["float32", False]),
            "bf16_fused_vs_float32": _agreement(out["bfloat16", True], out["float32", True]),
            "bf16_unfused_vs_float32": _agreement(out["bfloat16", False],
                                                  out["float32", True]),
            "bf16_fused_vs_unfused": _agreement(out["bfloat16", True], out["bfloat16", False])}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/row_quant")
    ap.add_argument("--engine-only", action="store_true", help="skip part 1 (the kernel rows)")
    ns = ap.parse_args()
    import jax

    rec = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
           "kernel": [] if ns.engine_only else kernel_rows()}
    rec["engine"] = engine_check()
    print("engine", json.dumps(rec["engine"]), flush=True)
    Path(ns.out).mkdir(parents=True, exist_ok=True)
    (Path(ns.out) / "check_row_quant.json").write_text(json.dumps(rec, indent=1))
    bad = [r for r in rec["kernel"] if r["scale_rel_err"] > 1e-5 or r["codes_differ"] > 1e-3]
    ok = not bad and all(rec["engine"]["float32_fused_vs_unfused"]["tokens_equal"])
    print("CHECK", "PASSED" if ok else f"FAILED ({len(bad)} kernel rows off)")


if __name__ == "__main__":
    main()
