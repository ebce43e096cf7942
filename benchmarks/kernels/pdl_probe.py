"""Does XLA's programmatic dependent launch (PDL) reach our Pallas kernels, and what does it
save per kernel? (GPU, Hopper or newer.)

Per-call fixed cost bounds the skinny decode GEMMs on the 17-67 MB weights (NOTES_matmul,
"Why the small weights stay below 3.6 TB/s": ~4.6 us a call on top of bytes / 4.27 TB/s). PDL
lets a kernel be launched while its predecessor still runs; XLA 0.11 has it behind
``xla_gpu_enable_pdl`` (``griddepcontrol.wait`` at the start of every kernel it generates,
Triton ones included; openxla/xla#38544) and ``xla_gpu_enable_pdl_launch`` (Triton GEMMs
trigger their successor before their epilogue; openxla/xla#43894), both on by default in
jaxlib 0.11.2 (the ``debug_options`` diff XLA dumps lists them only when set to false), so
``pdl_off`` is the set that differs from ``default``; the H200 (session 16) measured it 2 %
slower per GEMM.

For each set of compiler options this script compiles chains of R dependent GEMMs at M = 1 on
R distinct weights (R x bytes > L2, so every call streams its weight from HBM):

  fp8_o     our W8A8 path (``api.linear``, act_quant: per-token quantize + Triton FP8 GEMM),
            Llama-3.1-8B o_proj [4096, 4096] FP8 (16.8 MB),
  bf16_o    XLA's bf16 ``dot`` on the same shape (33.6 MB),

and reports wall microseconds per GEMM waited for (``sync``) and back to back (``b2b``), the
implied TB/s of weight bytes, and whether the outputs equal the default options' (bitwise).
With ``--dump`` XLA dumps the PDL variant (``xla_dump_to``) and each kernel entry of the PTX
found is checked for ``griddepcontrol.wait`` / ``griddepcontrol.launch_dependents``; in
session 16 (H200) the compile option wrote no ``.ptx``, which the script now reports (with the
suffixes it did write) instead of an empty check.

    PYTHONPATH=. python3 benchmarks/kernels/pdl_probe.py --out $OUT/pdl --dump
    PYTHONPATH=. python3 benchmarks/kernels/pdl_probe.py --xla-defaults --out /tmp/x  # CPU
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from decode_launch import VARIANTS  # noqa: E402 - benchmarks/ on the path above

# compiler option sets: decode_launch.py's PDL / command-buffer variants, and both together
OPTION_SETS = {k: VARIANTS[k] for k in ("default", "pdl_off", "pdl", "pdl_launch", "cb_off")}
OPTION_SETS["cb_off_pdl"] = {**VARIANTS["cb_off"], **VARIANTS["pdl_launch"]}


def ptx_entries(dump_dir: Path) -> dict[str, dict[str, int]]:
    """{kernel entry name: {"wait": n, "launch_dependents": n}} over every .ptx file XLA
    dumped (an entry's body runs from its ``.entry`` line to the next one)."""
    out: dict[str, dict[str, int]] = {}
    for f in sorted(dump_dir.rglob("*.ptx")):
        text = f.read_text(errors="replace")
        parts = re.split(r"^\s*\.(?:visible\s+)?\.?entry\s+", text, flags=re.M)
        for body in parts[1:]:
            name = re.match(r"[\w$.]+", body)
            key = name.group(0) if name else "?"
            out[key] = {"wait": body.count("griddepcontrol.wait"),
                        "launch_dependents": body.count("griddepcontrol.launch_dependents")}
    return out


def xla_default_diff(opts: dict) -> list[str]:
    """The ``debug_options`` lines XLA dumps for a tiny program compiled with ``opts``: the
    fields that differ from XLA's own defaults (any backend; the CPU jaxlib carries the same
    flag defaults). A scalar option missing here is set to XLA's default already (an emptied
    repeated field, ``cb_off``'s, does not show)."""
    import glob

    import jax
    import jax.numpy as jnp

    d = tempfile.mkdtemp(prefix="xla_defaults_")
    jax.jit(lambda x: x * 2 + 1).lower(jnp.ones(4)).compile(
        compiler_options={**opts, "xla_dump_to": d})
    text = open(glob.glob(d + "/*.debug_options")[0]).read()
    return [ln for ln in text.splitlines() if "xla_dump_to" not in ln]


def chain_fns(R: int, K: int, N: int):
    """(name, fn(x, weights), weights) for the two chains; N == K so outputs feed inputs."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels.matmul import api, quantize_rows_fp8

    assert N == K
    ws_bf16, ws_fp8 = [], []
    for r in range(R):
        w = jax.random.normal(jax.random.key(r), (K, N), jnp.bfloat16) * (1.0 / math.sqrt(K))
        ws_bf16.append(w)
        wq_t, s = quantize_rows_fp8(w.T)  # [N, K] fp8, [N] f32
        ws_fp8.append(api.PreparedWeight(wq_t, s, False))
    jax.block_until_ready((ws_bf16, ws_fp8))

    def fp8_chain(x, ws):
        for w in ws:
            x = api.linear(x, w, act_quant=True)
        return x

    def bf16_chain(x, ws):
        for w in ws:
            x = jnp.dot(x, w, preferred_element_type=jnp.float32).astype(jnp.bfloat16)
        return x

    return [("fp8_o", fp8_chain, ws_fp8, K * N), ("bf16_o", bf16_chain, ws_bf16, 2 * K * N)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="/tmp/pdl_probe")
    ap.add_argument("--sets", default=",".join(OPTION_SETS))
    ap.add_argument("--chain", type=int, default=32, help="GEMMs per compiled chain (R)")
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--dump", action="store_true", help="PTX of the pdl_launch variant")
    ap.add_argument("--xla-defaults", action="store_true",
                    help="only say which option sets differ from XLA's defaults (runs on CPU)")
    ns = ap.parse_args()
    if ns.xla_defaults:
        diff = {k: xla_default_diff(v) for k, v in OPTION_SETS.items()}
        Path(ns.out).mkdir(parents=True, exist_ok=True)
        (Path(ns.out) / "xla_defaults.json").write_text(json.dumps(diff, indent=1))
        for k, v in diff.items():
            print(f"{k:>12}: {v}")
        return

    import jax
    import jax.numpy as jnp
    from gpu_decode import median_time, pipelined_time

    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    x = jax.random.normal(jax.random.key(99), (1, ns.k), jnp.bfloat16)
    rec = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "chain": ns.chain,
           "K": ns.k, "N": ns.k, "M": 1, "results": {}}
    names = ns.sets.split(",")
    for cname, fn, ws, wbytes in chain_fns(ns.chain, ns.k, ns.k):
        ref = None
        for sname in names:
            opts = dict(OPTION_SETS[sname])
            dump = None
            if ns.dump and sname == "pdl_launch":
                dump = Path(tempfile.mkdtemp(prefix=f"pdl_{cname}_"))
                opts["xla_dump_to"] = str(dump)
            try:
                exe = jax.jit(fn).lower(x, ws).compile(compiler_options=opts)
            except Exception as e:  # noqa: BLE001 - record and go on
                rec["results"][f"{cname}/{sname}"] = {"error": repr(e)[:300]}
                print(cname, sname, "compile failed:", repr(e)[:200], flush=True)
                continue
            y = np.asarray(exe(x, ws), np.float32)
            ref = y if ref is None else ref
            sync = median_time(lambda: exe(x, ws), n=ns.iters)
            b2b = pipelined_time(lambda: exe(x, ws), n=ns.iters)
            r = {"options": OPTION_SETS[sname],
                 "sync_us_per_gemm": 1e6 * sync / ns.chain,
                 "b2b_us_per_gemm": 1e6 * b2b / ns.chain,
                 "b2b_TBps": wbytes / (b2b / ns.chain) / 1e12,
                 "finite": bool(np.isfinite(y).all()),
                 "equal_to_first": bool(np.array_equal(y, ref, equal_nan=True))}
            if dump is not None:
                ents = ptx_entries(dump)
                # session 16 on the H200: the compile option dumped no .ptx at all; keep what
                # it did write, and say so rather than report "no kernel has the wait"
                r["dump_suffixes"] = sorted({f.suffix for f in dump.rglob("*") if f.is_file()})
                if not ents:
                    print(f"{cname}: no .ptx under xla_dump_to ({r['dump_suffixes']}): the "
                          "griddepcontrol check did not run", flush=True)
                r["ptx_entries"] = len(ents)
                r["ptx_with_wait"] = sorted(k for k, v in ents.items() if v["wait"])
                r["ptx_with_launch_dependents"] = sorted(
                    k for k, v in ents.items() if v["launch_dependents"])
                r["ptx_without_wait"] = sorted(k for k, v in ents.items() if not v["wait"])
            rec["results"][f"{cname}/{sname}"] = r
            print(cname, sname, json.dumps({k: (round(v, 3) if isinstance(v, float) else v)
                                            for k, v in r.items() if k != "options"}),
                  flush=True)
            (out / "pdl_probe.json").write_text(json.dumps(rec, indent=1))
    print(f"\n{'chain/options':>22} {'sync us/GEMM':>13} {'b2b us/GEMM':>12} {'TB/s':>6} equal")
    for k, r in rec["results"].items():
        if "error" in r:
            print(f"{k:>22} error")
            continue
        print(f"{k:>22} {r['sync_us_per_gemm']:13.2f} {r['b2b_us_per_gemm']:12.2f} "
              f"{r['b2b_TBps']:6.2f} {r['equal_to_first']}")


if __name__ == "__main__":
    main()
