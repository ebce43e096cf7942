"""FP8 weight quantization accuracy on the real models: top-1 agreement and mean KL.

    .venv/bin/python benchmarks/fp8_accuracy.py [--models smollm2-135m gemma3-270m]

Text: the first --positions tokens of Python's own reference documentation
(``pydoc_data.topics``: real English prose, present in every CPython). Both sides run the
same paged engine path in float32 compute; the baseline keeps the checkpoint's weights, the
FP8 side quantizes every projection on load (per-output-channel e4m3). Per position:
top-1 agreement of the next-token argmax and KL(P_base || P_fp8). One JSON record each.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import record  # noqa: E402


def _text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def evaluate(model: str, positions: int, window: int) -> dict:
    from jaxinfer import LLM
    from jaxinfer.loading import load_model

    loaded = load_model(model, progress=False)
    ids = loaded.tokenizer.encode(_text())[: positions + 1]
    kw = dict(max_model_len=window, max_num_seqs=1, max_num_batched_tokens=256,
              dtype="float32")
    base = LLM(loaded, **kw)
    fp8 = LLM(loaded, quantization="fp8", **kw)
    agree, kls, n = 0, [], 0
    for start in range(0, positions, window):  # independent windows of real text
        chunk = ids[start:start + window]
        a = _log_softmax(base.engine.prompt_logits(chunk).astype(np.float64))
        b = _log_softmax(fp8.engine.prompt_logits(chunk).astype(np.float64))
        agree += int((a.argmax(-1) == b.argmax(-1)).sum())
        kls.append((np.exp(a) * (a - b)).sum(-1))
        n += len(chunk)
    kl = np.concatenate(kls)
    return {"positions": n, "top1_agreement": agree / n, "mean_kl": float(kl.mean()),
            "p99_kl": float(np.quantile(kl, 0.99))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["smollm2-135m", "gemma3-270m"])
    ap.add_argument("--positions", type=int, default=1024)
    ap.add_argument("--window", type=int, default=512)
    ns = ap.parse_args()
    print(f"{'model':>14} {'positions':>9} {'top-1 agree':>11} {'mean KL':>9} {'p99 KL':>8}")
    for m in ns.models:
        r = evaluate(m, ns.positions, ns.window)
        cfg = {"model": m, "positions": r["positions"], "window": ns.window,
               "baseline": "checkpoint weights, float32", "fp8": "per-channel e4m3 weights",
               "text": "pydoc_data.topics"}
        record("fp8_top1_agreement", r["top1_agreement"], "fraction", cfg)
        record("fp8_mean_kl", r["mean_kl"], "nats", {**cfg, "p99_kl": r["p99_kl"]})
        print(f"{m:>14} {r['positions']:>9} {r['top1_agreement']:>11.4f} {r['mean_kl']:>9.5f}"
              f" {r['p99_kl']:>8.4f}")


if __name__ == "__main__":
    main()
