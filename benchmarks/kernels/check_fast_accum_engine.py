"""GPU check: the FP8 decode GEMM's dots on wgmma (fp8_plan.FP8_DECODE_FAST_ACCUM) in the engine.

Each GEMM was checked against float32 alone (rel. L2 6.6-8.6e-4, session 13); here the whole
8B-shaped FP8 model (random weights, bf16 activations, Pallas attention) scores the same
prompts through the engine's paged path (``LLMEngine.prompt_logits``; prefill chunks of 16
and 64 rows run on the decode GEMM, where the switch acts) in four configurations, one engine
each in this process:

  fast_accum_on    the default
  fast_accum_off   $JAXINFER_FP8_DECODE_FAST_ACCUM=off (mma.sync, f16 after widening)
  off_wave2        off + $JAXINFER_FP8_DECODE_TILES=wave2: other split-K / tiles only, a
                   change of summation order — the noise floor of such a comparison
  xla_w8a16        the rows on XLA's W8A16 dot (no activation quantization, float32
                   accumulation; fp8_plan.FP8_DECODE_MAX_M = 0, $JAXINFER_FP8_MID_GEMM=xla)

and reports, per pair, the relative L2 difference of the logits, top-1 agreement and the
reference's top-1 - top-2 margin where they disagree. The check: fast_accum_on against
xla_w8a16 within 1.5x of fast_accum_off's difference to it (the switch may not add error
comparable to what W8A8 already has), and on a GPU on / off not identical (the switch acted)
— exit status 1 otherwise. On the CPU every variant runs XLA's dot (a smoke run).

  PYTHONPATH=. python3 benchmarks/kernels/check_fast_accum_engine.py --out $OUT/fast_accum
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

VARIANTS = {
    "fast_accum_on": ({}, {}),
    "fast_accum_off": ({"JAXINFER_FP8_DECODE_FAST_ACCUM": "off"}, {}),
    "off_wave2": ({"JAXINFER_FP8_DECODE_FAST_ACCUM": "off", "JAXINFER_FP8_DECODE_TILES": "wave2"},
                  {}),
    "xla_w8a16": ({"JAXINFER_FP8_MID_GEMM": "xla"}, {"FP8_DECODE_MAX_M": 0}),
}
PAIRS = [("fast_accum_on", "fast_accum_off"), ("off_wave2", "fast_accum_off"),
         ("fast_accum_on", "xla_w8a16"), ("fast_accum_off", "xla_w8a16"),
         ("off_wave2", "xla_w8a16")]


def compare(a: np.ndarray, ref: np.ndarray) -> dict:
    """Logits a, ref [N, V] float32 -> rel. L2, top-1 agreement, margins where they differ."""
    top_a, top_r = a.argmax(-1), ref.argmax(-1)
    srt = np.sort(ref, -1)
    margin = srt[:, -1] - srt[:, -2]
    bad = top_a != top_r
    return {"rel_l2": float(np.linalg.norm(a - ref) / np.linalg.norm(ref)),
            "max_abs": float(np.abs(a - ref).max()),
            "top1_agree": float(1 - bad.mean()), "positions": int(a.shape[0]),
            "ref_margin_median": float(np.median(margin)),
            "ref_margin_where_differ": [round(float(m), 4) for m in margin[bad][:20]]}


def scores(model, env: dict, consts: dict, prompts: list[list[int]]) -> tuple[list, float]:
    from jaxinfer.engine import LLMEngine
    from pallas_kernels.matmul import fp8_plan

    saved_env = {k: os.environ.get(k) for k in env}
    saved = {k: getattr(fp8_plan, k) for k in consts}
    os.environ.update(env)
    for k, v in consts.items():
        setattr(fp8_plan, k, v)
    try:
        t0 = time.perf_counter()
        eng = LLMEngine(model, dtype="bfloat16", attention_backend="pallas", quantization="fp8",
                        max_model_len=512, max_num_seqs=1, decode_buckets=(1,),
                        max_num_batched_tokens=64, prefill_buckets=(16, 64),
                        max_prefill_seqs=1, num_kv_pages=64)
        out = [eng.prompt_logits(p) for p in prompts]
        dt = time.perf_counter() - t0
        del eng
        gc.collect()
        return out, dt
    finally:
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        for k, v in saved.items():
            setattr(fp8_plan, k, v)


def to_records(summary: dict, command: str) -> list[dict]:
    """The summary's rows as benchmark records (``fp8_engine_logits_rel_l2``, one per pair
    and chunk size; top-1 agreement and the margins in the config)."""
    recs = []
    for r in summary["rows"]:
        cfg = {k: v for k, v in r.items() if k != "rel_l2"}
        cfg.update(model=summary["model"], check_ok=summary["check_ok"])
        recs.append({"name": "fp8_engine_logits_rel_l2", "value": r["rel_l2"],
                     "unit": "relative L2", "config": cfg, "device": summary["device"],
                     "jax": summary["jax"], "date": summary.get("date"), "command": command})
    return recs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/fast_accum")
    ap.add_argument("--model", default="dummy:llama-3.1-8b")
    ns = ap.parse_args()
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    import jax

    from jaxinfer.loading import load_model

    model = load_model(ns.model, dtype="bfloat16", quantization="fp8", progress=False)
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size
    # 256 tokens in chunks of 64 rows, 16 tokens in one chunk of 16 rows
    prompts = [rng.integers(0, vocab, 256).tolist(), rng.integers(0, vocab, 16).tolist()]
    logits, secs = {}, {}
    for name, (env, consts) in VARIANTS.items():
        logits[name], secs[name] = scores(model, env, consts, prompts)
        print(f"{name}: {secs[name]:.1f} s", flush=True)
    rows = []
    for a, b in PAIRS:
        for i, rows_per_chunk in enumerate((64, 16)):
            r = {"variant": a, "against": b, "chunk_rows": rows_per_chunk,
                 **compare(logits[a][i], logits[b][i])}
            rows.append(r)
            print(json.dumps(r), flush=True)
    rel = {(r["variant"], r["against"], r["chunk_rows"]): r["rel_l2"] for r in rows}
    ok = all(rel[("fast_accum_on", "xla_w8a16", c)] <= 1.5 * rel[("fast_accum_off", "xla_w8a16", c)]
             for c in (64, 16))
    if jax.default_backend() == "gpu":  # on the CPU every variant is XLA's dot: all equal
        # the switch must have acted (else the comparison says nothing)
        ok = ok and all(rel[("fast_accum_on", "fast_accum_off", c)] > 0 for c in (64, 16))
    summary = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
               "model": ns.model, "rows": rows, "seconds": secs, "check_ok": ok,
               "date": time.strftime("%Y-%m-%d")}
    (out / "fast_accum_engine.json").write_text(json.dumps(summary, indent=1))
    command = "PYTHONPATH=. python3 benchmarks/kernels/check_fast_accum_engine.py " + " ".join(
        sys.argv[1:])
    (out / "fast_accum_engine_records.json").write_text(
        json.dumps(to_records(summary, command), indent=1))
    print(f"\n{'variant':>15} {'against':>15} {'rows':>4} {'rel L2':>9} {'top-1':>7}")
    for r in rows:
        print(f"{r['variant']:>15} {r['against']:>15} {r['chunk_rows']:>4} {r['rel_l2']:>9.2e} "
              f"{100 * r['top1_agree']:>6.1f}%")
    print("CHECK", "OK" if ok else "FAILED: fast accum adds error beyond 1.5x mma.sync's")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
