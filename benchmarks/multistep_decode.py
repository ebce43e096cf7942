"""Several decode steps in one compiled program: what host launch cost does it remove? (GPU)

Session 11 found the 8B FP8 batch-1 decode step host-bound: the model program's dispatch
(XLA launches the step as one CUDA graph of ~600-800 nodes; ``cuGraphLaunch`` costs the host
~2 us a node) plus the sampler's and the engine's Python exceed the 3.2 ms device step, so
the engine's TPOT (4.39 ms) sits at the waited step, not at the device time
(NOTES_matmul "Session 11"). vLLM answered the same problem with multi-step scheduling
(``num_scheduler_steps``: N decode steps per scheduler call, the sampled token fed back on
the device). This script measures that design before the engine takes it: one program runs
``n`` decode steps of the engine's own model and greedy sampler under ``lax.fori_loop``
(the sampled token is the next step's input; positions, slot mapping and lengths advance on
the device from the block table), against the engine's one-step programs on the same inputs.

For each n: greedy tokens compared with n single steps (the run fails at its end if any
differ), and per generated token
  sync_ms   one call dispatched and waited for, / n,
  b2b_ms    calls issued back to back, one wait at the end, / n (best of 3),
  host_ms   host time until the call returns (enqueue only), / n.
n = 1 is the engine's path (model program + sampler program, as ``gpu_decode.decode_replay``).

  PYTHONPATH=. python3 benchmarks/multistep_decode.py --backend pallas:fp8 --batch 1 \\
      --steps 1,4,8,16 --out $OUT/multistep
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def build_multistep(runner, n: int):
    """A jitted program of ``n`` greedy decode steps of ``runner``'s model:
    (weights, cache, counts, token_ids [S], md, sampling arrays) -> (tokens [n, S] int32,
    cache, counts), cache and counts donated. Step i+1's input token is step i's sample; its
    position is one more, its slot ``block_tables[row, pos // page] * page + pos % page`` and
    its length one more (decode rows: token i is row i)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxinfer.sampling import SAMPLER_VARIANTS, sample_rows

    graphdef, tree, attention = runner.graphdef, runner.weights_tree, runner.attention
    ps, needs = runner.page_size, SAMPLER_VARIANTS["greedy"]

    def multi(weights, cache, counts, toks, md, sa):
        model = nnx.merge(graphdef, jax.tree.unflatten(tree, weights))
        rows = jnp.arange(toks.shape[0])

        def body(i, carry):
            cache, counts, toks, md, out = carry
            hidden, cache = model(toks, cache, md, attention)
            so, counts, _ = sample_rows(model.logits(hidden[md.logits_indices]), sa, counts, needs)
            pos = md.positions + 1
            slot = md.block_tables[rows, pos // ps] * ps + pos % ps
            md = dataclasses.replace(md, positions=pos, slot_mapping=slot,
                                     seq_lens=md.seq_lens + 1)
            return cache, counts, so.tokens, md, out.at[i].set(so.tokens)

        out = jnp.zeros((n, toks.shape[0]), jnp.int32)
        cache, counts, _, _, out = jax.lax.fori_loop(0, n, body, (cache, counts, toks, md, out))
        return out, cache, counts

    return jax.jit(multi, donate_argnums=(1, 2))


def single_chain(eng, bucket, toks, md, sa, n: int) -> np.ndarray:
    """n greedy steps through the engine's programs (model, then sampler), metadata advanced
    on the host: the reference for the multi-step program's tokens. Returns [n, S]."""
    runner = eng.runner
    exe = runner.executable(bucket)
    ps = runner.page_size
    bt = np.asarray(md.block_tables)
    rows = np.arange(len(toks))
    out = []
    for _ in range(n):
        logits, runner.cache = exe(runner.weights, runner.cache, toks, md)
        toks = runner.sample(logits, sa, "greedy").tokens
        out.append(np.asarray(toks))
        pos = np.asarray(md.positions) + 1
        md = dataclasses.replace(md, positions=pos, slot_mapping=bt[rows, pos // ps] * ps
                                 + pos % ps, seq_lens=np.asarray(md.seq_lens) + 1)
    return np.stack(out)


def step_inputs(eng, b: int, ctx: int, max_steps: int):
    """``gpu_decode.decode_inputs`` for b rows at position ctx, with each row its own pages up
    to the last position ``max_steps`` steps write (decode_inputs covers ctx only; a later
    position in the null page would be shared by the rows) and the first step's KV slot in
    the row's page of ctx. Returns (bucket, token ids, AttentionMetadata, SamplingArrays).
    Raises SystemExit when the pages do not fit the pool or the bucket's block table."""
    import jax
    from gpu_decode import decode_inputs

    runner = eng.runner
    bucket, toks, md, sa = decode_inputs(eng, b, ctx, distinct=True)
    ps = runner.page_size
    per_row = (ctx + max_steps) // ps + 1
    if b * per_row >= runner.num_pages or per_row > bucket.max_pages:
        raise SystemExit(f"{b} x {per_row} pages do not fit the pool / bucket {bucket}")
    bt = np.zeros((b, bucket.max_pages), np.int32)
    bt[:, :per_row] = 1 + np.arange(b * per_row).reshape(b, per_row)
    md = dataclasses.replace(md, block_tables=jax.numpy.asarray(bt), slot_mapping=jax.numpy.asarray(
        bt[:, ctx // ps] * ps + ctx % ps))
    return bucket, toks, md, sa


def main() -> None:
    from gpu_decode import add_step_shape_args, make_engine, median_time, pipelined_time

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_step_shape_args(ap)
    ap.add_argument("--steps", default="1,4,8,16", help="decode steps per program")
    ap.add_argument("--reps", type=int, default=8, help="calls per timing")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", default="benchmarks/results/multistep")
    ns = ap.parse_args()

    import jax

    try:
        steps = [int(s) for s in ns.steps.split(",")]
    except ValueError:
        ap.error(f"--steps: comma-separated integers, got {ns.steps!r}")
    if min(steps) < 1 or ns.batch < 1 or ns.ctx < 1:
        ap.error("--steps, --batch and --ctx must be at least 1")
    from jaxinfer.config import ConfigError

    t0 = time.perf_counter()
    try:  # positions up to ctx + max(steps) - 1 are written
        eng = make_engine(ns.model, ns.backend, [ns.batch], ns.ctx, max(steps), dtype=ns.dtype)
    except ConfigError as e:
        ap.error(f"the engine refuses this shape: {e}")
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    runner = eng.runner
    bucket, toks, md, sa = step_inputs(eng, ns.batch, ns.ctx, max(steps))
    runner.executable(bucket)
    print(f"engine + first compile {time.perf_counter() - t0:.1f} s", flush=True)
    rec = {"model": ns.model, "backend": ns.backend, "batch": ns.batch, "ctx": ns.ctx,
           "dtype": ns.dtype, "device": jax.devices()[0].device_kind, "jax": jax.__version__,
           "variants": {}}
    # The reference: max(steps) single steps from the fixed inputs (they write the KV of
    # positions ctx .. ctx+n-1; every multi-step call below rewrites the same slots with
    # the same values, so each starts from the same state).
    ref = single_chain(eng, bucket, toks, md, sa, max(steps))
    for n in steps:
        t1 = time.perf_counter()
        if n == 1:
            exe = runner.executable(bucket)

            def replay():  # the engine's step: model program, then greedy sampler program
                logits, runner.cache = exe(runner.weights, runner.cache, toks, md)
                return runner.sample(logits, sa, "greedy")

            fn, got = replay, None
        else:
            prog = build_multistep(runner, n).lower(
                runner.weights, runner.cache, runner.counts, toks, md, sa).compile()

            def fn(prog=prog):
                got, runner.cache, runner.counts = prog(runner.weights, runner.cache,
                                                        runner.counts, toks, md, sa)
                return got

            got = np.asarray(fn())
        host = []  # enqueue time of a call, the previous one finished
        for _ in range(ns.reps):
            jax.block_until_ready(runner.cache)
            ta = time.perf_counter()
            r = fn()
            host.append(time.perf_counter() - ta)
            jax.block_until_ready(r)
        compile_s = time.perf_counter() - t1  # compile + first call + these reps (as recorded)
        v = {"compile_s": compile_s,
             "sync_ms": 1e3 * median_time(fn, n=ns.reps) / n,
             "b2b_ms": 1e3 * pipelined_time(fn, n=ns.reps) / n,
             "host_ms": 1e3 * float(np.median(host)) / n}
        if got is not None:
            v["tokens_equal"] = bool((got == ref[:n]).all())
            v["tokens_equal_rows"] = int((got == ref[:n]).all(0).sum())
        rec["variants"][f"n{n}"] = v
        print(f"n{n}", json.dumps(v), flush=True)
    stamp = time.strftime("%Y%m%dT%H%M%S")
    (out / f"multistep-{ns.backend.replace(':', '_')}-b{ns.batch}-{stamp}.json").write_text(
        json.dumps(rec, indent=1))
    print(f"\n{ns.backend} B{ns.batch} ctx{ns.ctx}: ms per generated token")
    print(f"{'steps':>6} {'sync':>8} {'b2b':>8} {'host':>8}  tokens")
    for k, v in rec["variants"].items():
        eq = v.get("tokens_equal", "ref")
        print(f"{k:>6} {v['sync_ms']:8.3f} {v['b2b_ms']:8.3f} {v['host_ms']:8.3f}  {eq}")
    bad = [k for k, v in rec["variants"].items() if v.get("tokens_equal") is False]
    if bad:
        raise SystemExit(f"CHECK FAILED: tokens differ from single steps for {bad}")


if __name__ == "__main__":
    main()
