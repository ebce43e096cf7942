"""FP8 KV cache accuracy on a real model: top-1 agreement and mean KL against the auto cache.

    .venv/bin/python benchmarks/fp8_kv_accuracy.py [--models smollm2-135m] [--positions 1024]

Same text and metrics as benchmarks/fp8_accuracy.py (FP8 weights), imported from there: the
first --positions tokens of ``pydoc_data.topics`` in independent windows of --window tokens,
each window's logits through the engine's paged prefill path (``prompt_logits``, chunks of
256 tokens, so later chunks read earlier chunks' K/V back from the pages). The baseline runs
``kv_cache_dtype="auto"`` (the model dtype: float32 here); the FP8 side ``"fp8"`` (e4m3) with
per-layer scales 1.0 (vLLM's default without calibrated scales) and, with ``--scales
calibrated``, absmax / 448 per layer and for K and V, measured on the --window tokens that
follow the evaluated ones (a checkpoint's calibrated scales would be of this kind). Per
position: top-1 agreement of the next-token argmax and KL(P_auto || P_fp8). Also recorded:
the largest |K| and |V| the baseline cache held (against e4m3's 448: does scale 1.0 saturate).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import record
from benchmarks.fp8_accuracy import _log_softmax, _text


def _absmax_scales(llm, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Per-layer absmax / 448 of K and of V after ``llm`` (unquantized cache) prefills ids."""
    llm.engine.prompt_logits(ids)
    k, v = (np.abs(np.asarray(x)) for x in (llm.engine.runner.cache.k,
                                              llm.engine.runner.cache.v))
    return k.reshape(k.shape[0], -1).max(1) / 448, v.reshape(v.shape[0], -1).max(1) / 448


def evaluate(model: str, positions: int, window: int, scales: str = "one") -> dict:
    from jaxinfer import LLM
    from jaxinfer.layers.attention import allocate_kv_cache
    from jaxinfer.loading import load_model

    loaded = load_model(model, progress=False)
    text = loaded.tokenizer.encode(_text())
    ids = text[: positions + 1]
    kw = {"max_model_len": window, "max_num_seqs": 1, "max_num_batched_tokens": 256,
          "dtype": "float32"}
    base = LLM(loaded, **kw)
    fp8 = LLM(loaded, kv_cache_dtype="fp8", **kw)
    if scales == "calibrated":  # before fp8 writes anything: scales fix the stored values
        r, c = fp8.engine.runner, loaded.config
        r.cache = allocate_kv_cache(c.num_layers, c.num_kv_heads, r.num_pages, r.page_size,
                                    c.head_dim, r.cache.dtype,
                                    _absmax_scales(base, text[positions + 1:][:window]),
                                    per_layer=r.cache.per_layer)
    agree, kls, n, kmax, vmax = 0, [], 0, 0.0, 0.0
    for start in range(0, positions, window):  # independent windows of real text
        chunk = ids[start:start + window]
        a = _log_softmax(base.engine.prompt_logits(chunk).astype(np.float64))
        b = _log_softmax(fp8.engine.prompt_logits(chunk).astype(np.float64))
        cache = base.engine.runner.cache  # this window's K/V, unquantized
        kmax = max(kmax, float(np.abs(np.asarray(cache.k)).max()))
        vmax = max(vmax, float(np.abs(np.asarray(cache.v)).max()))
        agree += int((a.argmax(-1) == b.argmax(-1)).sum())
        kls.append((np.exp(a) * (a - b)).sum(-1))
        n += len(chunk)
    kl = np.concatenate(kls)
    return {"positions": n, "top1_agreement": agree / n, "mean_kl": float(kl.mean()),
            "p99_kl": float(np.quantile(kl, 0.99)), "max_abs_k": kmax, "max_abs_v": vmax,
            "kv_dtype": str(fp8.engine.runner.cache.dtype)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["smollm2-135m"])
    ap.add_argument("--positions", type=int, default=1024)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--scales", nargs="+", default=["one", "calibrated"],
                    choices=["one", "calibrated"])
    ns = ap.parse_args()
    rows = []
    for m in ns.models:
        for sc in ns.scales:
            r = evaluate(m, ns.positions, ns.window, sc)
            how = ("1.0" if sc == "one" else
                   f"absmax/448 per layer from the {ns.window} tokens after the evaluated ones")
            cfg = {"model": m, "positions": r["positions"], "window": ns.window,
                   "baseline": "kv_cache_dtype auto (float32)",
                   "fp8": f"kv_cache_dtype fp8 ({r['kv_dtype']}), scales {how}", "scales": sc,
                   "weights": "checkpoint, float32", "text": "pydoc_data.topics",
                   "max_abs_k": r["max_abs_k"], "max_abs_v": r["max_abs_v"]}
            record("fp8_kv_top1_agreement", r["top1_agreement"], "fraction", cfg)
            record("fp8_kv_mean_kl", r["mean_kl"], "nats", {**cfg, "p99_kl": r["p99_kl"]})
            rows.append((m, sc, r))
    print(f"{'model':>14} {'scales':>10} {'positions':>9} {'top-1 agree':>11} {'mean KL':>9} "
          f"{'p99 KL':>8} {'max|K|':>7} {'max|V|':>7}")
    for m, sc, r in rows:
        print(f"{m:>14} {sc:>10} {r['positions']:>9} {r['top1_agreement']:>11.4f} "
              f"{r['mean_kl']:>9.5f} {r['p99_kl']:>8.4f} {r['max_abs_k']:>7.1f} "
              f"{r['max_abs_v']:>7.1f}")


if __name__ == "__main__":
    main()
