"""GPU check, end to end: the engine with the Mosaic GPU prefill kernel (backend "pallas_mgpu")
against the Triton kernels ("pallas") and the jnp reference ("reference"), issue #3 item 7.

A small random Llama (2 layers, Hq 8, Hkv 2, D 128: the head dim the Mosaic kernel takes) in
bf16, prompts of 700-5000 tokens in prefill buckets of 1024 / 4096 tokens, so that the buckets
>= ``MGPU_MIN_TOKENS`` lower the Mosaic kernel; a prompt longer than the largest bucket is
prefilled in chunks (the second chunk attends to the first one's pages) and two prompts share a
1,600-token prefix (the second one's prefill reads the cached pages). Per backend: the prompt
logprobs of every prompt position (the prefill attention of every token shows in them) and 8
greedy tokens. Reported: max |prompt logprob difference| against the reference and how many
greedy continuations are identical (bf16 paths round differently, so a random model may flip a
near-tie: reported, and the logprob difference says whether a flip is a near-tie).

    PYTHONPATH=. python3 benchmarks/kernels/check_mgpu_engine.py --out $OUT/records
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

BACKENDS = ("reference", "pallas", "pallas_mgpu")


def prompts(rng: np.random.Generator, vocab: int) -> list[list[int]]:
    shared = rng.integers(3, vocab, 1600).tolist()
    out = [rng.integers(3, vocab, n).tolist() for n in (700, 2100, 3000, 5000)]
    out += [shared + rng.integers(3, vocab, 300).tolist(),
            shared + rng.integers(3, vocab, 900).tolist()]
    return out


def run_backend(backend: str, ps: list[list[int]]) -> tuple[list[np.ndarray], list[list[int]]]:
    from jaxinfer import LLM, SamplingParams

    llm = LLM("dummy:check-llama-d128", dtype="bfloat16", attention_backend=backend,
              max_model_len=8192, max_num_seqs=8, max_num_batched_tokens=4096,
              max_prefill_seqs=4, prefill_buckets=(1024, 4096), decode_buckets=(1, 8),
              num_kv_pages=4096, async_scheduling=False)
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, prompt_logprobs=0)
    lps, toks = [], []
    for i, p in enumerate(ps):  # one at a time: the shared prefix is cached for the 6th
        o = llm.generate([p], sp)[0]
        lps.append(np.array([e[p[j]] for j, e in enumerate(o.prompt_logprobs) if j > 0]))
        toks.append(list(o.outputs[0].token_ids))
    return lps, toks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results")
    ns = ap.parse_args()
    import jax

    from jaxinfer.loading.dummy import DUMMY_CONFIGS

    base = DUMMY_CONFIGS["tiny-llama"]
    DUMMY_CONFIGS["check-llama-d128"] = dataclasses.replace(
        base, vocab_size=512, hidden_size=1024, intermediate_size=2048, num_layers=2,
        num_heads=8, num_kv_heads=2, head_dim=128, max_position_embeddings=8192,
        name="dummy:check-llama-d128")
    ps = prompts(np.random.default_rng(0), 512)
    res, t0 = {}, time.time()
    for be in BACKENDS:
        t = time.time()
        res[be] = run_backend(be, ps)
        print(f"{be}: {time.time() - t:.1f} s", flush=True)
    ref_lp, ref_tok = res["reference"]
    rows = {}
    for be in BACKENDS[1:]:
        lp, tok = res[be]
        rows[be] = {
            "max_abs_prompt_logprob_diff": float(max(np.abs(a - b).max() for a, b in zip(lp, ref_lp))),
            "mean_abs_prompt_logprob_diff": float(np.mean([np.abs(a - b).mean() for a, b in zip(lp, ref_lp)])),
            "greedy_identical": sum(a == b for a, b in zip(tok, ref_tok)),
            "prompts": len(ps)}
    # the two kernels against each other too
    lp_a, tok_a = res["pallas"]
    lp_b, tok_b = res["pallas_mgpu"]
    rows["pallas_mgpu_vs_pallas"] = {
        "max_abs_prompt_logprob_diff": float(max(np.abs(a - b).max() for a, b in zip(lp_a, lp_b))),
        "greedy_identical": sum(a == b for a, b in zip(tok_a, tok_b)), "prompts": len(ps)}
    ref_scale = float(np.mean([np.abs(a).mean() for a in ref_lp]))
    rec = {"name": "check_mgpu_engine", "value": rows["pallas_mgpu"]["max_abs_prompt_logprob_diff"],
           "unit": "max |prompt logprob - reference's| (nats)",
           "config": {"model": "dummy:check-llama-d128 (2 layers, Hq 8, Hkv 2, D 128, vocab 512)",
                      "dtype": "bfloat16", "prompt_lens": [len(p) for p in ps],
                      "prefill_buckets": [1024, 4096], "mean_abs_reference_logprob": ref_scale,
                      "rows": rows},
           "device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
           "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
           "command": "PYTHONPATH=. python3 benchmarks/kernels/check_mgpu_engine.py --out DIR"}
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"check_mgpu_engine-{time.strftime('%Y%m%dT%H%M%S')}.json").write_text(json.dumps(rec, indent=1))
    print(f"total {time.time() - t0:.1f} s; mean |reference prompt logprob| {ref_scale:.3f}")
    print("| backend | max abs dlogprob | mean abs dlogprob | greedy identical |")
    print("|---|---:|---:|---:|")
    for be, r in rows.items():
        print(f"| {be} | {r['max_abs_prompt_logprob_diff']:.4f} | "
              f"{r.get('mean_abs_prompt_logprob_diff', float('nan')):.5f} | "
              f"{r['greedy_identical']}/{r['prompts']} |")


if __name__ == "__main__":
    main()
