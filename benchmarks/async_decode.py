"""Engine time per decode step with and without async scheduling (CPU or GPU).

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/async_decode.py [--model dummy:tiny-llama]
        [--batches 1 16] [--new-tokens 64] [--runs 3] [--waves 1] [--out benchmarks/results]

B sequences of 16-token prompts decode ``--new-tokens`` tokens each (temperature 1, seeded,
EOS ignored) in one engine with ``async_scheduling`` off and one with it on. Per run: the
wall time of the ``step()`` calls after the first decode step, divided by the steps they
returned (each ``step()`` returns one step's tokens in both modes; with async scheduling
the next step is already in flight). Median over ``--runs`` runs, after a compiling warm-up
run. Also checks that both engines return the same tokens. One JSON record per number
(``async_decode_step_ms``).

``--waves M`` queues M x B requests into the engine of ``max_num_seqs`` = B (an offline run
with a waiting queue): wave i+1 waits while wave i decodes and is admitted (one prefill
step, counted among the steps) when it ends; ``pipelined_while_waiting`` counts the steps
dispatched ahead while requests waited.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from jaxinfer.bench.records import record


def measure(model: str, B: int, async_scheduling: bool, runs: int, new_tokens: int,
            waves: int = 1) -> tuple[float, list[float], int, int, list]:
    """(median ms per step, per-run ms, pipelined steps of the last run, of them those
    dispatched while requests waited, tokens)."""
    from jaxinfer.engine import LLMEngine
    from jaxinfer.sampling_params import SamplingParams

    eng = LLMEngine(model, max_model_len=256, max_num_seqs=B, max_num_batched_tokens=2048,
                    max_prefill_seqs=64, decode_buckets=(B,), prefill_buckets=(2048,),
                    num_kv_pages=B * 16 + 8, async_scheduling=async_scheduling)
    rng = np.random.default_rng(0)
    launch_next = eng._launch_next
    ahead_waiting = [0]

    def spy(cur):  # count the steps dispatched ahead while requests wait
        waiting = bool(eng.scheduler.waiting)
        nxt = launch_next(cur)
        ahead_waiting[0] += nxt is not None and waiting
        return nxt

    eng._launch_next = spy

    def run(n_out: int) -> tuple[float, list]:
        for i in range(B * waves):
            eng.add_request(rng.integers(0, 200, 16).tolist(),
                            SamplingParams(temperature=1.0, max_tokens=n_out, ignore_eos=True,
                                           seed=i))
        eng.step()  # the prefill step (its first token)
        eng.step()  # the first decode step (synchronous in both modes)
        toks: dict[int, list[int]] = {}
        steps, t = 0, time.perf_counter()
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.finished:
                    toks[o.request_id] = o.outputs[0].token_ids
            steps += 1
        return (time.perf_counter() - t) / steps * 1e3, [toks[k] for k in sorted(toks)]

    run(4)  # compile
    per_run, tokens = [], []
    for _ in range(runs):
        before, before_waiting = eng.num_pipelined_steps, ahead_waiting[0]
        ms, tokens = run(new_tokens)
        per_run.append(ms)
    return (float(np.median(per_run)), per_run, eng.num_pipelined_steps - before,
            ahead_waiting[0] - before_waiting, tokens)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="dummy:tiny-llama")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--waves", type=int, default=1,
                    help="queue waves x B requests (max_num_seqs B): a waiting queue")
    ap.add_argument("--out", default=None, help="records directory (default benchmarks/results)")
    a = ap.parse_args()
    for B in a.batches:
        ref = None
        for mode in (False, True):
            ms, per_run, pipelined, waiting, tokens = measure(a.model, B, mode, a.runs,
                                                              a.new_tokens, a.waves)
            if ref is None:
                ref = tokens
            same = tokens == ref
            record("async_decode_step_ms", ms, "ms",
                   {"model": a.model, "batch": B, "async_scheduling": mode,
                    "new_tokens": a.new_tokens, "waves": a.waves,
                    "runs_ms": [round(x, 3) for x in per_run],
                    "pipelined_steps_last_run": pipelined,
                    "pipelined_while_waiting_last_run": waiting,
                    "tokens_equal_sync": same}, a.out)
            print(f"{a.model} B={B} async={mode}: {ms:.2f} ms/step (runs "
                  f"{', '.join(f'{x:.2f}' for x in per_run)}), pipelined {pipelined} "
                  f"({waiting} while requests waited), "
                  f"tokens equal sync: {same}", flush=True)


if __name__ == "__main__":
    main()
