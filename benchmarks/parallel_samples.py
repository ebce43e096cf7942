"""KV pages and prefill work of one request with ``n`` samples against ``n`` separate
requests of the same prompt (CPU; the page counts do not depend on the device).

    .venv/bin/python benchmarks/parallel_samples.py [--model dummy:tiny-llama] [--n 8]
        [--prompt 200] [--max-tokens 32] [--block-size 16] [--max-num-batched-tokens T]

Three ways to get ``n`` seeded samples (temperature 0.8) of one random ``--prompt``-token
prompt, each in a fresh engine (prefix caching on):

  n        one request, ``SamplingParams(n=N, seed=s)``: one prefill, samples share the
           prompt's pages (copy-on-write of the partial last page);
  together N requests with seeds s .. s+N-1 submitted at once: with the default token
           budget (N x prompt) all are prefilled in the same step, so the prefix cache has
           nothing to share yet (a smaller budget spreads them over steps, and the later
           ones hit the cache);
  serial   the same N requests one after another: the later ones find the prompt's full
           pages in the prefix cache.

Reported per way: the peak of KV pages in use after any step, the prompt tokens computed in
prefill steps, and engine steps. Sample i of the ``n`` request draws with seed s + i, so it
must equal separate request i token for token: the run asserts that. One JSON record per
number in benchmarks/results/ (``samples_*``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import record


def _run(llm, batches: list[list[tuple[list[int], object]]]) -> tuple[dict, list[list[int]]]:
    """Run each batch of (prompt, params) to completion in order; returns the measurements
    and every sample's tokens (in request, then sample order)."""
    eng = llm.engine
    sched, bm = eng.scheduler, eng.scheduler.block_manager
    stats = {"peak_pages": 0, "prefill_tokens": 0, "steps": 0}
    plan = sched.schedule

    def counting():
        out = plan()
        if out.is_prefill:
            stats["prefill_tokens"] += out.num_batched_tokens
        return out

    sched.schedule = counting
    tokens: list[list[int]] = []
    for batch in batches:
        ids = [eng.add_request(p, sp) for p, sp in batch]
        done = {}
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.finished:
                    done[o.request_id] = o
            stats["steps"] += 1
            stats["peak_pages"] = max(stats["peak_pages"], bm.num_used_pages)
        tokens += [c.token_ids for i in ids for c in done[i].outputs]
    return stats, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="dummy:tiny-llama")
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=200, help="prompt tokens")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="prefill token budget (default: n x prompt)")
    ns = ap.parse_args()

    import numpy as np

    from jaxinfer.llm import LLM
    from jaxinfer.sampling_params import SamplingParams

    budget = ns.max_num_batched_tokens or ns.n * ns.prompt
    args = {"max_model_len": ns.prompt + ns.max_tokens, "block_size": ns.block_size,
            "max_num_seqs": ns.n, "max_num_batched_tokens": budget}
    seed = 1234

    def sp(n: int, s: int) -> SamplingParams:
        return SamplingParams(temperature=0.8, max_tokens=ns.max_tokens, ignore_eos=True, n=n,
                              seed=s)

    results = {}
    prompt: list[int] | None = None
    for way in ("n", "together", "serial"):
        llm = LLM(ns.model, **args)
        if prompt is None:
            V = llm.engine.model_config.vocab_size
            prompt = np.random.default_rng(0).integers(10, V, ns.prompt).tolist()
        separate = [(prompt, sp(1, seed + i)) for i in range(ns.n)]
        batches = {"n": [[(prompt, sp(ns.n, seed))]], "together": [separate],
                   "serial": [[r] for r in separate]}[way]
        results[way] = _run(llm, batches)  # counts only: no timing, so no warm-up
    ref = results["together"][1]
    assert results["n"][1] == ref == results["serial"][1], "sample i != request seeded s + i"
    print(f"{ns.model}: prompt {ns.prompt} tokens, {ns.n} samples x {ns.max_tokens} tokens, "
          f"block_size {ns.block_size}, token budget {budget} (samples equal the separate "
          f"requests token for token)")
    print(f"{'way':10} {'peak KV pages':>14} {'prefill tokens':>15} {'steps':>6}")
    for way, (st, _) in results.items():
        print(f"{way:10} {st['peak_pages']:>14} {st['prefill_tokens']:>15} {st['steps']:>6}")
        cfg = {"way": way, "model": ns.model, "n": ns.n, "prompt_tokens": ns.prompt,
               "max_tokens": ns.max_tokens, "block_size": ns.block_size,
               "max_num_batched_tokens": budget,
               "prefix_caching": True, "steps": st["steps"]}
        record("samples_kv_pages_peak", st["peak_pages"], "pages", cfg)
        record("samples_prefill_tokens", st["prefill_tokens"], "tokens", cfg)


if __name__ == "__main__":
    main()
