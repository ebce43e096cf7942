"""The stall a new sampler variant causes under multi-step decode, inline build vs background.

    PYTHONPATH=. python3 benchmarks/variant_stall.py --out $OUT [--model llama-3.1-8b]
        [--quantization fp8] [--k 8] [--streams 8]
        [--modes background,background_long_switch,background_unfrozen,inline]

After a server's warm-up (``jaxinfer.warmup.warm_up``: every decode bucket's one-step
program with all sampler variants, and the greedy / temperature k-step programs), ``--streams``
greedy requests decode; at step 10 one top-p request arrives, whose sampler variant has no
k-step program yet. ``inline`` (the engine before 42a4b21, kept as a patch of
``engine_multi._one_step_meanwhile``): the first window with that variant compiles it, and
every stream waits. ``background`` (the default now): those windows run as one step while the
program builds on a background thread at a 0.5 ms switch interval
(``runner_multi.BACKGROUND_SWITCH_INTERVAL_S``), with the garbage collector's heap frozen
after the warm-up as ``InferenceServer.start`` does (``warmup.freeze_gc_heap``; both since
session 41); ``background_long_switch``: the same at Python's 5 ms; ``background_unfrozen``:
neither (session 40's server). Each mode runs in a fresh process (a
second engine in one process would find XLA's autotuning results warm), with random weights
at ``--model``'s shape and decode buckets ``--decode-buckets`` (a few, to keep the warm-up
short).

Measured per mode: the longest ``engine.step()`` wall time from the top-p request's arrival
on (the stall), the median and the longest step before it, the top-p request's time to
first token, the windows run as one step meanwhile, the steps' wall time from the arrival on
(``decode_after_s``), the new program's trace and lowering (``trace_lower_s``: the part that
holds the GIL; XLA's compile releases it) and its whole background build
(``background_build_s``, which may end after the streams), and the first tokens of the top-p
request and of stream 0 (equal across modes: same weights and seeds). Prints a table; one
JSON record per number (benchmarks/common.record).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.common import device_name, record  # noqa: E402


def child(ns: argparse.Namespace, mode: str) -> dict:
    import numpy as np

    from jaxinfer import engine_multi, runner_multi
    from jaxinfer.engine import LLMEngine
    from jaxinfer.sampling_params import SamplingParams
    from jaxinfer.warmup import freeze_gc_heap, warm_up

    if mode == "inline":
        engine_multi._one_step_meanwhile = lambda *a: False
    if mode in ("background_long_switch", "background_unfrozen"):  # before session 41
        runner_multi.BACKGROUND_SWITCH_INTERVAL_S = sys.getswitchinterval()
    spans: dict[str, list[tuple[float, float]]] = {"lower": [], "build": []}
    timed(runner_multi.MultiStepPrograms, "lower", spans["lower"])
    timed(runner_multi.MultiStepPrograms, "_build_logged", spans["build"])
    t0 = time.perf_counter()
    buckets = tuple(int(b) for b in ns.decode_buckets.split(","))
    eng = LLMEngine(f"dummy:{ns.model}", quantization=ns.quantization,
                    num_scheduler_steps=ns.k, decode_buckets=buckets,
                    max_num_seqs=max(buckets), max_model_len=ns.max_model_len)
    start_s = time.perf_counter() - t0
    warm_s = warm_up(eng, prefill_buckets=True)  # as serve on a GPU: no prefill compile
    frozen = (freeze_gc_heap() if mode in ("background", "background_long_switch")
              else 0)  # as InferenceServer.start
    greedy = SamplingParams(max_tokens=ns.new_tokens, temperature=0.0, ignore_eos=True)
    rng = np.random.default_rng(0)
    V = eng.model_config.vocab_size
    rids = [eng.add_request(rng.integers(1, V, ns.prompt_len).tolist(), greedy)
            for _ in range(ns.streams)]
    steps, arrival, first, top_p_id, tokens = [], None, None, None, {}
    n_compiled = eng.runner.num_compilations
    while eng.has_unfinished_requests():
        if len(steps) == 10:
            arrival = len(steps)
            top_p_id = eng.add_request(rng.integers(1, V, ns.prompt_len).tolist(),
                                       SamplingParams(max_tokens=ns.new_tokens // 2,
                                                      temperature=0.8, top_p=0.9, seed=3,
                                                      ignore_eos=True))
            t_arrival = time.perf_counter()
        t = time.perf_counter()
        outs = eng.step()
        steps.append(time.perf_counter() - t)
        for o in outs:
            tokens[o.request_id] = o.outputs[0].token_ids
            if o.request_id == top_p_id and first is None and o.outputs[0].token_ids:
                first = time.perf_counter() - t_arrival
    eng.multi_step_programs.wait_background()
    if arrival is None or first is None:
        raise SystemExit(f"the streams finished in {len(steps)} steps, before the top-p "
                         f"request's step 10 or its first token: raise --new-tokens")
    after = steps[arrival:]
    lowered = [b - a for a, b in spans["lower"] if a >= t_arrival]  # not the warm-up's
    built = [b - a for a, b in spans["build"] if a >= t_arrival]
    return {"mode": mode, "device": device_name(),
            "start_s": start_s, "warm_up_s": warm_s,
            "gc_frozen_objects": frozen,
            "stall_ms": 1e3 * max(after), "median_step_before_ms": 1e3 * float(
                np.median(steps[2:arrival])), "max_step_before_ms": 1e3 * max(
                steps[2:arrival]), "median_step_after_ms": 1e3 * float(
                np.median(after)), "top_p_ttft_ms": 1e3 * first,
            "one_step_windows": eng.num_one_step_windows, "multi_steps": eng.num_multi_steps,
            "compiled_after_warm_up": eng.runner.num_compilations - n_compiled,
            "decode_after_s": float(sum(after)),
            "trace_lower_s": lowered[0] if lowered else None,
            "background_build_s": built[0] if built else None,
            "steps": len(steps), "steps_after_ms": [round(1e3 * t, 2) for t in after[:24]],
            "top_p_tokens": tokens[top_p_id][:8],
            "stream0_tokens": tokens[rids[0]][:8]}


def timed(cls: type, name: str, spans: list[tuple[float, float]]) -> None:
    """Wrap method ``name`` of ``cls`` to append each call's (start, end) perf_counter."""
    real = getattr(cls, name)

    def wrapper(self, *args, **kw):
        t = time.perf_counter()
        try:
            return real(self, *args, **kw)
        finally:
            spans.append((t, time.perf_counter()))

    setattr(cls, name, wrapper)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--quantization", default=None)
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--decode-buckets", default="8,16")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=160)
    p.add_argument("--modes", default="background,background_unfrozen,inline")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ns = p.parse_args()
    if ns.child:
        print("RESULT " + json.dumps(child(ns, ns.child)), flush=True)
        return
    ns.out.mkdir(parents=True, exist_ok=True)
    command = "PYTHONPATH=. python3 " + " ".join(sys.argv)
    rows = []
    for mode in ns.modes.split(","):
        proc = subprocess.run([sys.executable, *sys.argv, "--child", mode],
                              capture_output=True, text=True)
        line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        if proc.returncode or not line:
            print(proc.stdout[-3000:], proc.stderr[-3000:], sep="\n")
            raise SystemExit(f"mode {mode} failed (rc {proc.returncode})")
        r = json.loads(line[0][7:])
        rows.append(r)
        cfg = {k: getattr(ns, k) for k in ("model", "quantization", "k", "streams",
                                           "decode_buckets", "prompt_len", "new_tokens")}
        cfg |= {k: r[k] for k in ("mode", "gc_frozen_objects", "one_step_windows",
                                  "multi_steps", "steps",
                                  "steps_after_ms",
                                  "compiled_after_warm_up", "warm_up_s", "top_p_tokens",
                                  "stream0_tokens")}
        for name, unit in (("stall_ms", "ms"), ("median_step_before_ms", "ms"),
                           ("max_step_before_ms", "ms"),
                           ("median_step_after_ms", "ms"), ("top_p_ttft_ms", "ms"),
                           ("decode_after_s", "s"), ("trace_lower_s", "s"),
                           ("background_build_s", "s")):
            if r[name] is None:  # inline: no background build
                continue
            record(f"variant_stall_{name}", r[name], unit, {**cfg, "device": r["device"]},
                   ns.out, command)
    print(f"{'mode':<22} {'stall ms':>9} {'step before':>11} {'max before':>10} {'after':>7} "
          f"{'top-p TTFT':>10} {'1-step win':>10} {'windows':>7} {'compiled':>8} "
          f"{'after s':>7} {'lower s':>7} {'build s':>7}")
    for r in rows:
        print(f"{r['mode']:<22} {r['stall_ms']:9.1f} {r['median_step_before_ms']:11.2f} "
              f"{r['max_step_before_ms']:10.1f} "
              f"{r['median_step_after_ms']:7.2f} {r['top_p_ttft_ms']:10.1f} "
              f"{r['one_step_windows']:10d} {r['multi_steps']:7d} "
              f"{r['compiled_after_warm_up']:8d} {r['decode_after_s']:7.2f} "
              f"{_s(r['trace_lower_s'])} {_s(r['background_build_s'])}")
    same = len({(tuple(r["top_p_tokens"]), tuple(r["stream0_tokens"])) for r in rows}) == 1
    print("same tokens across modes:", same)


def _s(v: float | None) -> str:
    return f"{v:7.2f}" if v is not None else f"{'-':>7}"


if __name__ == "__main__":
    main()
