"""Op counts of the compiled sampler programs: a device-free proxy for kernel launches.

    .venv/bin/python benchmarks/sampler_hlo_ops.py                       # S 1 and 256, V 128256
    .venv/bin/python benchmarks/sampler_hlo_ops.py --buffer-method search,sort,topk \\
        --variants top_k_top_p top_k_top_p_logprobs --batches 1 256

Compiles ``sampling.sample_rows`` for each (``sampling_filters.BUFFER_METHOD``, variant of
``SAMPLER_VARIANTS``, batch) on the local backend and counts, in the optimised HLO
(``jax.jit(...).lower(...).compile().as_text()``), the instructions of the computations that
launch work -- the entry and the bodies / conditions of while loops (the searches'
``fori_loop``s) -- not those inside fusions, reducers or comparators:

* fusions: ``fusion`` instructions (one kernel each on XLA:GPU);
* ops: every instruction but parameter / constant / tuple / get-tuple-element / bitcast and
  the control ops (while / call / conditional): fusions, sorts, custom calls, unfused
  elementwise ops, copies;
* executed: ops with each while body and condition counted as often as it runs (its trip
  count, from ``known_trip_count`` or the condition's constant bound).

A PROXY: XLA:CPU's fusion and loop decisions are not XLA:GPU's (the GPU also runs a sort as
several kernels, TopK as one, and keeps a known-trip-count loop's condition on the host), so
only the differences between programs compiled the same way mean something; the kernel count
of a GPU trace (``benchmarks/sampling_cost.py``'s ``kernels`` column) is the measurement.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

_HEADER = re.compile(r"^(ENTRY )?%(\S+) \(.*\{$")
_INSTR = re.compile(r"^\s+(?:ROOT )?%\S+ = .*? ([a-z][a-z0-9\-]*)\(")
_FREE = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast"}
_CONTROL = {"while", "call", "conditional"}


def _computations(text: str) -> tuple[dict[str, list[str]], str]:
    comps, entry, cur = {}, "", None
    for line in text.splitlines():
        m = _HEADER.match(line)
        if m:
            cur = m.group(2)
            comps[cur] = []
            if m.group(1):
                entry = cur
        elif line.startswith("}"):
            cur = None
        elif cur is not None and " = " in line:
            comps[cur].append(line)
    return comps, entry


def _trip_count(line: str, comps: dict[str, list[str]], cond: str) -> int:
    m = re.search(r'known_trip_count[^0-9]*?"?n"?\s*:\s*"?(\d+)', line)
    if m:
        return int(m.group(1))
    bounds = [int(v) for ln in comps.get(cond, []) for v in re.findall(
        r"s32\[\] constant\((\d+)\)", ln)]
    return max(bounds) if bounds else 1


def count_ops(text: str) -> dict[str, int]:
    """{'fusions', 'ops', 'executed', 'sorts', 'whiles'} of an optimised HLO module's text."""
    comps, entry = _computations(text)
    out = {"fusions": 0, "ops": 0, "executed": 0, "sorts": 0, "whiles": 0}

    def walk(name: str, times: int) -> None:
        for line in comps.get(name, []):
            m = _INSTR.match(line)
            if not m:
                continue
            op = m.group(1)
            if op == "while":
                out["whiles"] += 1
                body = re.search(r"body=%([^\s,]+)", line).group(1)
                cond = re.search(r"condition=%([^\s,]+)", line).group(1)
                n = _trip_count(line, comps, cond)
                walk(body, times * n)
                walk(cond, times * (n + 1))
            elif op in ("call", "conditional"):
                for callee in re.findall(
                        r"(?:to_apply|branch_computations|true_computation|"
                        r"false_computation)=\{?%([^\s,}]+)", line):
                    walk(callee, times)
            elif op not in _FREE:
                out["executed"] += times
                out["ops"] += 1
                out["fusions"] += op == "fusion"
                out["sorts"] += op == "sort"

    walk(entry, 1)
    return out


def compiled_text(variant: str, S: int, V: int) -> str:
    import jax
    import jax.numpy as jnp

    from jaxinfer.batch import SamplingArrays
    from jaxinfer.sampling import SAMPLER_VARIANTS, sample_rows

    sds = jax.ShapeDtypeStruct
    sa = SamplingArrays(*(sds(a.shape, a.dtype) for a in SamplingArrays.neutral(S)))
    # A fresh function each time: jit's trace cache would not see the module's tunables.
    return jax.jit(lambda *a: sample_rows(*a), static_argnums=3).lower(
        sds((S, V), jnp.float32), sa, sds((S + 1, V), jnp.int32),
        SAMPLER_VARIANTS[variant]).compile().as_text()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 256])
    ap.add_argument("--variants", nargs="+",
                    default=["top_k_top_p", "top_k_top_p_logprobs", "temperature"])
    ap.add_argument("--buffer-method", default="search,sort,topk")
    ap.add_argument("--draw-method", default="threefry",
                    help="comma list of sampling.DRAW_METHOD values (threefry, hash)")
    ap.add_argument("--select-method", default="topk",
                    help="comma list of sampling_topk.SELECT_METHOD values (topk, sort)")
    a = ap.parse_args()
    import jax

    from jaxinfer import sampling
    from jaxinfer import sampling_filters as sf
    from jaxinfer import sampling_topk as topk

    print(f"backend {jax.default_backend()}, vocab {a.vocab} (a proxy: see the docstring)")
    print("| variant | S | method | fusions | ops | executed ops | sorts | whiles |")
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    methods = [(b, d, m) for b in a.buffer_method.split(",") for d in a.draw_method.split(",")
               for m in a.select_method.split(",")]
    for variant in a.variants:
        for S in a.batches:
            for method, draw, select in methods:
                sf.BUFFER_METHOD, sampling.DRAW_METHOD, topk.SELECT_METHOD = method, draw, select
                c = count_ops(compiled_text(variant, S, a.vocab))
                name = "/".join(v for v, d in ((method, ""), (draw, "threefry"),
                                               (select, "topk")) if v != d)
                print(f"| {variant} | {S} | {name} | {c['fusions']} | {c['ops']} | "
                      f"{c['executed']} | {c['sorts']} | {c['whiles']} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
