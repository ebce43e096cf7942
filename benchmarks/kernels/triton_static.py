"""Static analysis of the paged decode kernel without a GPU: Triton 3.6 compile for sm_90.

Two steps, two interpreters (jaxlib's Triton is not importable; PyPI's triton wheel is
cp311 here):

    # 1. in the project venv: lower every sweep config for an abstract H200 and keep the
    #    Triton IR Pallas emits (TTIR, one file a config, and index.json)
    JAX_PLATFORMS=cpu PYTHONPATH=. .venv/bin/python benchmarks/kernels/triton_static.py \\
        capture --dir /tmp/ttir [--shape 32,2048] [--configs cvt,kq8]
    # 2. in a Python 3.11 venv with triton 3.6 (python3.11 -m venv /tmp/tri311 &&
    #    /tmp/tri311/bin/pip install triton==3.6.0): compile for sm_90, read the SASS
    /tmp/tri311/bin/python benchmarks/kernels/triton_static.py compile --dir /tmp/ttir

``capture-gemm`` (the FP8 decode GEMM) and ``capture-small`` (session 24's RoPE + KV write and
split-K norm-quant kernels) capture other kernels for the same compile step.

Prints, per config: registers, shared memory, programs an SM can hold (registers and shared
memory of an H200 SM: 64 K registers, 227 KB), the SASS instructions of the inner loop (the
largest backward branch) with the counts that matter here (HMMA, one-byte LDS.U8 gathers,
F2FP conversions), spills, and the K/V shared buffers (stages: 2x = prefetch); every
opcode count of each inner loop goes to ``<dir>/loop_ops.json``. XLA's own
Triton (jaxlib 0.11.2) may differ in detail; findings: NOTES_paged_attention.md.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys


def capture(args) -> None:
    sys.path.insert(0, os.getcwd())
    import jax
    import jax.numpy as jnp

    from benchmarks.kernels.bench_paged_attention import parse_heads
    from benchmarks.kernels.bench_paged_fp8_sweep import CONFIGS
    from pallas_kernels.paged_attention import paged_decode_attention
    from tests.kernels.cuda_lowering import lower_paged_kernel, triton_ir

    with triton_ir() as seen:
        B, ctx = (int(x) for x in args.shape.split(","))
        Hq, Hkv, D = parse_heads(args.heads).values()
        ps, L = args.page, 2
        maxp = ctx // ps
        configs = CONFIGS + [("bf16_default", {"kv": "bf16"}, None),
                             ("fp8_default", {"kv": "fp8"}, None)]
        if args.configs:
            configs = [c for c in configs if c[0] in args.configs.split(",")]
        os.makedirs(args.dir, exist_ok=True)
        index = []
        for name, kw, _ in configs:
            kw = dict(kw)
            kv = jnp.float8_e4m3fn if kw.pop("kv") == "fp8" else jnp.bfloat16
            sds = jax.ShapeDtypeStruct
            avals = [sds((B, Hq, D), jnp.bfloat16), sds((L, Hkv, B * maxp + 1, ps, D), kv),
                     sds((L, Hkv, B * maxp + 1, ps, D), kv), sds((), jnp.int32),
                     sds((B, maxp), jnp.int32), sds((B,), jnp.int32)]
            seen.clear()
            lower_paged_kernel(paged_decode_attention, avals, kv, 0, **kw)
            with open(os.path.join(args.dir, f"{name}.ttir"), "w") as f:
                f.write(seen[0])
            from pallas_kernels.paged_attention.decode_options import (
                _resolve_options,
                launch_grid,
            )
            o = _resolve_options(kv, kw.get("fp8_variant"), B, Hkv, D, **{k: kw.get(k) for k in (
                "block_tokens", "num_splits", "target_programs", "wave_slots", "num_warps",
                "num_stages", "fp8_widen", "fp8_dots", "layout", "group_rows", "fp8_v_stage")})
            *_, stages = launch_grid(o, kv, B, Hkv, maxp, ps, D)
            index.append({"name": name, "num_warps": o["num_warps"], "num_stages": stages})
            print("captured", name, flush=True)
        with open(os.path.join(args.dir, "index.json"), "w") as f:
            json.dump({"shape": args.shape, "configs": index}, f, indent=1)


def capture_gemm(args) -> None:
    """The engine's Triton W8A8 decode GEMM (fp8_plan.fp8_decode_config) at ``--gemm K,N``
    for 1 / 16 / 32 / 64 tokens, each with the FP8 dot as f16 mma.sync (``_mma``) and on
    wgmma (``_wgmma``, TritonConfig.fast_accum), the stages as the plan sets them."""
    import dataclasses
    sys.path.insert(0, os.getcwd())
    import jax
    import jax.numpy as jnp

    from pallas_kernels.matmul import fp8_plan
    from pallas_kernels.matmul.triton_gemm import triton_linear
    from tests.kernels.cuda_lowering import lower_for_cuda, triton_ir

    with triton_ir() as seen:
        K, N = (int(v) for v in args.gemm.split(","))
        fp8, f32, sds = jnp.float8_e4m3fn, jnp.float32, jax.ShapeDtypeStruct
        os.makedirs(args.dir, exist_ok=True)
        index = []
        for M in (1, 16, 32, 64):
            plan = fp8_plan.fp8_decode_config(M, K, N, fuse="none")
            for kind, fast in (("mma", False), ("wgmma", True)):
                c = plan if plan.fast_accum == fast else dataclasses.replace(
                    plan, fast_accum=fast,
                    num_stages=plan.num_stages + (-1 if fast else 1) if plan.bk == 256 else
                    plan.num_stages)
                seen.clear()
                lower_for_cuda(lambda x, w, ws, xs, c=c: triton_linear(x, w, ws, x_scale=xs,
                                                                      config=c),
                               sds((M, K), fp8), sds((N, K), fp8), sds((N,), f32), sds((M,), f32))
                name = f"m{M}_{kind}"
                with open(os.path.join(args.dir, f"{name}.ttir"), "w") as f:
                    f.write(seen[0])
                index.append({"name": name, "num_warps": c.num_warps, "num_stages": c.num_stages})
                print("captured", name, c, flush=True)
        with open(os.path.join(args.dir, "index.json"), "w") as f:
            json.dump({"shape": f"K,N = {K},{N}", "configs": index}, f, indent=1)


def capture_small(args) -> None:
    """Session 24's small kernels at the 8B decode shapes: rope_kv_write (RoPE + KV write:
    bf16 QKV at 1 row, the FP8 GEMM's split-K partials at 64 rows, Gemma 3 270M's QK norm
    at D 256, Qwen2's QKV bias) and norm_quant_fp8 with a split-K residual (1 / 64 rows,
    4096 columns, 4 partials): do they compile for sm_90, registers, spills."""
    sys.path.insert(0, os.getcwd())
    import jax
    import jax.numpy as jnp

    from pallas_kernels.matmul import row_quant
    from pallas_kernels.matmul.triton_gemm import SplitKPartials
    from pallas_kernels.paged_attention.rope_kv_write import rope_write_kv_pallas
    from tests.kernels.cuda_lowering import lower_for_cuda, triton_ir

    sds, bf, f32, f8 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.float32, jnp.float8_e4m3fn
    cases = []
    for name, T, Hq, Hkv, D, extra in (("rope_8b_b1", 1, 32, 8, 128, ""),
                                       ("rope_8b_b64_sk4", 64, 32, 8, 128, "split4"),
                                       ("rope_g270_b32_norm", 32, 4, 1, 256, "norm"),
                                       ("rope_qwen2_b64_bias", 64, 28, 4, 128, "bias")):
        W = (Hq + 2 * Hkv) * D
        pool = sds((2, Hkv, 4096, 16, D), f8)

        def fn(kc, vc, lay, qkv, cos, sin, slots, ks, vs, *ex, Hq=Hq, D=D, extra=extra):
            kw = {}
            if extra == "split4":
                qkv = SplitKPartials(qkv, ex[0], ex[1], bf)
            elif extra == "norm":
                kw = dict(q_norm=ex[0], k_norm=ex[1])
            elif extra == "bias":
                kw = dict(bias=ex)
            return rope_write_kv_pallas(kc, vc, lay, qkv, cos, sin, slots, Hq, ks, vs, **kw)

        qkv = sds((4, T, W), f32) if extra == "split4" else sds((T, W), bf)
        ex = {"split4": [sds((T,), f32), sds((W,), f32)], "norm": [sds((D,), bf)] * 2,
              "bias": [sds((Hq * D,), bf), sds((Hkv * D,), bf), sds((Hkv * D,), bf)]}
        avals = [pool, pool, sds((), jnp.int32), qkv, sds((T, D), f32), sds((T, D), f32),
                 sds((T,), jnp.int32), sds((), f32), sds((), f32), *ex.get(extra, [])]
        cases.append((name, fn, avals, 1))
    for M in (1, 64):
        def nq(x, p, xs, ws, w):
            return row_quant.norm_quant_fp8(x, w, 1e-5,
                                            residual=SplitKPartials(p, xs, ws, bf))
        cases.append((f"normquant_sk4_m{M}", nq,
                      [sds((M, 4096), bf), sds((4, M, 4096), f32), sds((M,), f32),
                       sds((4096,), f32), sds((4096,), bf)], row_quant.ROW_QUANT_WARPS))
    os.makedirs(args.dir, exist_ok=True)
    index = []
    with triton_ir() as seen:
        for name, fn, avals, warps in cases:
            seen.clear()
            lower_for_cuda(fn, *avals)
            with open(os.path.join(args.dir, f"{name}.ttir"), "w") as f:
                f.write(seen[0])
            index.append({"name": name, "num_warps": warps, "num_stages": 1})
            print("captured", name, flush=True)
    with open(os.path.join(args.dir, "index.json"), "w") as f:
        json.dump({"shape": "session 24 small kernels", "configs": index}, f, indent=1)


def loop_ops(sass: str) -> collections.Counter:
    """Opcode counts of the largest loop (backward branch) in ``cuobjdump -sass`` text."""
    ins = [(int(m.group(1), 16), m.group(2).strip()) for m in
           re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    at = {a: i for i, (a, _) in enumerate(ins)}
    best = (0, 0, -1)
    for i, (a, t) in enumerate(ins):
        m = re.search(r"BRA\s+.*?(0x[0-9a-f]+)", t)
        if m and int(m.group(1), 16) < a and int(m.group(1), 16) in at:
            s = at[int(m.group(1), 16)]
            best = max(best, (i - s + 1, s, i))
    return collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0]
                               for _, t in ins[best[1]:best[2] + 1])


def compile_all(args) -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with open(os.path.join(args.dir, "index.json")) as f:
        index = json.load(f)
    print(f"shape B,ctx = {index['shape']}; Triton {triton.__version__}, sm_90")
    all_ops = {}
    print(f"{'config':20s} {'w':>2s} {'st':>2s} {'regs':>4s} {'smemKB':>6s} {'/SM':>3s} "
          f"{'loop':>5s} {'HMMA':>4s} {'GMMA':>4s} {'LDS.U8':>6s} {'F2FP':>4s} {'spill':>5s}  "
          "K/V buffers")
    for c in index["configs"]:
        try:
            k = triton.compile(os.path.join(args.dir, c["name"] + ".ttir"),
                               target=GPUTarget("cuda", 90, 32),
                               options={"num_warps": c["num_warps"],
                                        "num_stages": c["num_stages"]})
        except Exception as ex:  # noqa: BLE001  report and go on
            print(f"{c['name']:20s} FAILED {type(ex).__name__}: {str(ex)[:300]}")
            continue
        cubin = os.path.join(args.dir, c["name"] + ".cubin")
        with open(cubin, "wb") as f:
            f.write(k.asm["cubin"])
        sass = subprocess.run([os.path.join(tools, "cuobjdump"), "-sass", cubin],
                              capture_output=True, text=True, check=True).stdout
        ops = loop_ops(sass)
        res = subprocess.run([os.path.join(tools, "cuobjdump"), "-res-usage", cubin],
                             capture_output=True, text=True, check=True).stdout
        regs = int(re.search(r"REG:(\d+)", res).group(1))
        threads = 32 * c["num_warps"]
        spills = len(re.findall(r"\bSTL", sass))
        per_sm = min(65536 // (-(-regs // 8) * 8 * threads),
                     (227 * 1024) // max(k.metadata.shared + 1024, 1), 32)
        bufs = re.findall(r"local_alloc[^\n]*?!ttg\.memdesc<(\dx\d+x\d+x\w+)", k.asm["ttgir"])
        print(f"{c['name']:20s} {c['num_warps']:2d} {c['num_stages']:2d} {regs:4d} "
              f"{k.metadata.shared / 1024:6.0f} {per_sm:3d} {sum(ops.values()):5d} "
              f"{sum(v for o, v in ops.items() if o.startswith('HMMA')):4d} "
              f"{sum(v for o, v in ops.items() if 'GMMA' in o):4d} {ops['LDS.U8']:6d} "
              f"{sum(v for o, v in ops.items() if o.startswith('F2FP')):4d} "
              f"{spills:5d}  {' '.join(sorted(set(bufs)))}", flush=True)
        all_ops[c["name"]] = {"regs": regs, "smem_bytes": k.metadata.shared, "spills": spills,
                              "loop_ops": dict(sorted(ops.items()))}
    # every opcode of each config's inner loop (the table above shows a few columns)
    with open(os.path.join(args.dir, "loop_ops.json"), "w") as f:
        json.dump({"shape": index["shape"], "triton": triton.__version__, "target": "sm_90",
                   "configs": all_ops}, f, indent=1)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("step", choices=["capture", "capture-gemm", "capture-small", "compile"])
    p.add_argument("--dir", default="/tmp/paged_decode_ttir")
    p.add_argument("--shape", default="32,2048", help="B,ctx (capture)")
    p.add_argument("--configs", default="", help="comma list of sweep names (capture)")
    p.add_argument("--page", type=int, default=16, help="page size in tokens (capture)")
    p.add_argument("--heads", default="32/8/128", help="Hq/Hkv/D (capture)")
    p.add_argument("--gemm", default="8192,28672", help="K,N (capture-gemm)")
    args = p.parse_args()
    {"capture": capture, "capture-gemm": capture_gemm, "capture-small": capture_small,
     "compile": compile_all}[args.step](args)


if __name__ == "__main__":
    main()
