"""Host time of ``LLMEngine.step()`` per decode step on a tiny random model (CPU).

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/host_step_time.py [--batches 16 256]
        [--label HEAD] [--out benchmarks/results] [--prompt-len 16] [--max-model-len 256]
        [--runs 3] [--new-tokens 64] [--output-kind cumulative|delta|final_only]

B sequences of 16-token prompts decode 64 tokens each (temperature 1, EOS ignored), three
times per batch size. Per step: wall time of ``step()``, "device" = the compiled program's
call waited for (the runner's executables are wrapped), host = step - device (scheduling,
building the step's arrays, postprocessing, outputs). Medians over the steps of a run, then
over the three runs; the first step of each run (its prefill) is dropped. The model is tiny,
so the device part is small and the host part is what a large model's step adds on top of
its program. ``--label`` names the code measured (run an older checkout with
``PYTHONPATH=<its root>`` to compare). One JSON record per number.
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np

from jaxinfer.bench.records import record  # not benchmarks.common: runs against older checkouts too


def measure(B: int, runs: int = 3, new_tokens: int = 64, prompt_len: int = 16,
            max_model_len: int = 256, output_kind: str = "cumulative") -> dict[str, float]:
    import dataclasses

    from jaxinfer.engine import LLMEngine
    from jaxinfer.loading import dummy
    from jaxinfer.sampling_params import SamplingParams

    if max_model_len > dummy.DUMMY_CONFIGS["tiny-llama"].max_position_embeddings:
        dummy.DUMMY_CONFIGS["tiny-llama"] = dataclasses.replace(
            dummy.DUMMY_CONFIGS["tiny-llama"], max_position_embeddings=max_model_len)
    pages = -(-(prompt_len + new_tokens) // 16) + 1
    eng = LLMEngine("dummy:tiny-llama", max_model_len=max_model_len, max_num_seqs=B,
                    max_num_batched_tokens=max(2048, prompt_len), max_prefill_seqs=64,
                    decode_buckets=(B,), prefill_buckets=(max(2048, prompt_len),),
                    num_kv_pages=B * max(16, pages) + 8)
    device = [0.0]
    executable = eng.runner.executable

    def timed_executable(bucket, mode="sample"):
        exe = executable(bucket, mode)

        def call(*args):
            t = time.perf_counter()
            out = jax.block_until_ready(exe(*args))
            device[0] += time.perf_counter() - t
            return out
        return call

    eng.runner.executable = timed_executable
    rng = np.random.default_rng(0)

    kind = {} if output_kind == "cumulative" else {"output_kind": output_kind}  # older code

    def run(n_out: int) -> tuple[np.ndarray, np.ndarray]:
        for _ in range(B):
            eng.add_request(rng.integers(0, 200, prompt_len).tolist(),
                            SamplingParams(temperature=1.0, max_tokens=n_out, ignore_eos=True,
                                           **kind))
        steps, devs = [], []
        while eng.has_unfinished_requests():
            device[0] = 0.0
            t = time.perf_counter()
            eng.step()
            steps.append(time.perf_counter() - t)
            devs.append(device[0])
        return np.array(steps[1:]), np.array(devs[1:])

    run(4)  # compile
    res = []
    for _ in range(runs):
        st, dv = run(new_tokens)
        tail = max(1, len(st) // 10)  # the last tenth of the steps: the longest outputs
        res.append((np.median(st), np.median(dv), np.median(st - dv),
                    np.median((st - dv)[-tail:])))
    step, dev, host, host_last = np.median(np.array(res), axis=0) * 1e3
    return {"step_ms": step, "device_ms": dev, "host_ms": host, "host_last_tenth_ms": host_last}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[16, 256])
    ap.add_argument("--label", default="HEAD", help="the code measured, for the records")
    ap.add_argument("--out", default=None, help="records directory (default benchmarks/results)")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=256,
                    help="block-table width = this / 16 pages (the bench suites: 4352)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=64, help="tokens each sequence decodes")
    ap.add_argument("--output-kind", default="cumulative",
                    help="SamplingParams.output_kind: cumulative, delta, final_only")
    a = ap.parse_args()
    for B in a.batches:
        r = measure(B, a.runs, a.new_tokens, a.prompt_len, a.max_model_len, a.output_kind)
        for k, v in r.items():
            record(f"host_step_{k.removesuffix('_ms')}_ms", float(v), "ms",
                   {"batch": B, "model": "dummy:tiny-llama", "label": a.label,
                    "prompt_len": a.prompt_len, "max_model_len": a.max_model_len,
                    "new_tokens": a.new_tokens, "output_kind": a.output_kind}, a.out)
        print(f"{a.label} B={B} prompt {a.prompt_len} new {a.new_tokens} max_model_len "
              f"{a.max_model_len} {a.output_kind}: step {r['step_ms']:.2f} ms, device "
              f"{r['device_ms']:.2f} ms, host {r['host_ms']:.2f} ms (last tenth of the steps "
              f"{r['host_last_tenth_ms']:.2f} ms)", flush=True)


if __name__ == "__main__":
    main()
