"""Sampling cost per decode step: the on-device sampler alone, jitted, on random logits.

    .venv/bin/python benchmarks/sampling_cost.py                 # vocab 128256, batch 1 and 256
    .venv/bin/python benchmarks/sampling_cost.py --smoke         # tiny shapes: checks it runs

Times ``jaxinfer.sampling.sample_rows`` (what the compiled decode step runs after the LM head)
for parameter mixes that take different paths: all greedy (argmax only), temperature, top-k /
top-p (a vocabulary sort), min-p, penalties (gather of [B, V] count rows), logprobs (log-softmax
and top-20), everything at once, and half greedy / half everything. The penalty state is
donated as in the engine. Median of ``--iters`` runs after warm-up, in microseconds; one record
per (mix, batch) in benchmarks/results/ (benchmarks/common.py).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import record  # noqa: E402

ALL = dict(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05, repetition_penalty=1.1,
           presence_penalty=0.2, frequency_penalty=0.1, want_logprobs=True)
MIXES: dict[str, dict] = {
    "greedy": {},
    "temperature": dict(temperature=0.8),
    "top_k_top_p": dict(temperature=0.8, top_k=50, top_p=0.9),
    "top_p": dict(temperature=0.8, top_p=0.9),
    "min_p": dict(temperature=0.8, min_p=0.05),
    "penalties": dict(repetition_penalty=1.1, presence_penalty=0.2, frequency_penalty=0.1),
    "logprobs": dict(want_logprobs=True),
    "all": ALL,
    "half_greedy_half_all": {k: ("half", v) for k, v in ALL.items()},
}


def params(B: int, mix: dict):
    from jaxinfer.batch import SamplingArrays

    sa = SamplingArrays.neutral(B)
    sa.seeds[:] = np.stack([np.arange(B), np.zeros(B)], 1)
    sa.slots[:] = np.arange(B)
    for name, v in mix.items():
        arr = getattr(sa, name)
        if isinstance(v, tuple):  # ("half", value): the odd rows only
            arr[1::2] = v[1]
        else:
            arr[:] = v
    return sa


def time_mix(B: int, V: int, mix: dict, iters: int, dtype: str) -> float:
    """Median seconds of one sample_rows call on [B, V] logits."""
    import jax
    import jax.numpy as jnp

    from jaxinfer.batch import SamplingArrays
    from jaxinfer.sampling import sample_rows

    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.standard_normal((B, V)) * 3, dtype)
    sa = SamplingArrays(*map(jnp.asarray, params(B, mix)))
    counts = jnp.zeros((B + 1, V), jnp.int32)
    counts = counts.at[:B, : V // 8].set(1)  # some history (prompt and output tokens)
    fn = jax.jit(sample_rows, donate_argnums=(2,))
    for _ in range(3):
        out, counts = fn(logits, sa, counts)
        jax.block_until_ready(out)
    ts = []
    for i in range(iters):
        sa = sa._replace(sample_index=sa.sample_index + 1)  # a fresh draw each step
        t0 = time.perf_counter()
        out, counts = fn(logits, sa, counts)
        jax.block_until_ready(out)
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 256])
    ap.add_argument("--mixes", nargs="+", default=list(MIXES), choices=list(MIXES))
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="logits dtype (the sampler computes in float32)")
    ap.add_argument("--smoke", action="store_true",
                    help="vocab 2048, batches 1 and 8, 3 iterations; no records written")
    ap.add_argument("--out", type=Path, default=None, help="results directory")
    a = ap.parse_args()
    if a.smoke:
        a.vocab, a.batches, a.iters = 2048, [1, 8], 3
    import jax

    print(f"device {jax.devices()[0].device_kind} ({jax.default_backend()}), vocab {a.vocab}, "
          f"logits {a.dtype}")
    print(f"{'mix':22}" + "".join(f"{'B=' + str(b):>12}" for b in a.batches) + "   (us/step)")
    for name in a.mixes:
        cells = []
        for B in a.batches:
            s = time_mix(B, a.vocab, MIXES[name], a.iters, a.dtype)
            cells.append(f"{s * 1e6:12.1f}")
            if not a.smoke:
                record(f"sampling_cost_us_{name}_b{B}", s * 1e6, "us",
                       {"vocab": a.vocab, "batch": B, "mix": MIXES[name] and
                        {k: str(v) for k, v in MIXES[name].items()}, "iters": a.iters,
                        "logits_dtype": a.dtype}, out_dir=a.out)
        print(f"{name:22}" + "".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
