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
        all_ops[c["name"]] = {"regs": regs, "smem_bytes": k.metadata.shared,
                              "loop_ops": dict(sorted(ops.items()))}
    # every opcode of each config's inner loop (the table above shows a few columns)
    with open(os.path.join(args.dir, "loop_ops.json"), "w") as f:
        json.dump({"shape": index["shape"], "triton": triton.__version__, "target": "sm_90",
                   "configs": all_ops}, f, indent=1)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("step", choices=["capture", "capture-gemm", "compile"])
    p.add_argument("--dir", default="/tmp/paged_decode_ttir")
    p.add_argument("--shape", default="32,2048", help="B,ctx (capture)")
    p.add_argument("--configs", default="", help="comma list of sweep names (capture)")
    p.add_argument("--page", type=int, default=16, help="page size in tokens (capture)")
    p.add_argument("--heads", default="32/8/128", help="Hq/Hkv/D (capture)")
    p.add_argument("--gemm", default="8192,28672", help="K,N (capture-gemm)")
    args = p.parse_args()
    {"capture": capture, "capture-gemm": capture_gemm, "compile": compile_all}[args.step](args)


if __name__ == "__main__":
    main()
