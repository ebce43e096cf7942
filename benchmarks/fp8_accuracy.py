"""FP8 weight quantization accuracy on the real models: top-1 agreement and mean KL.

    .venv/bin/python benchmarks/fp8_accuracy.py [--models smollm2-135m gemma3-270m]
        [--variants fp8-channel fp8-g128 fp8-gptq ...] [--w8a8] [--calib-windows 8]

Text: the first --positions tokens of Python's own reference documentation
(``pydoc_data.topics``: real English prose, present in every CPython), in independent
--window-token windows. Every variant runs the same paged engine path
(``LLMEngine.prompt_logits``) and is compared per position with a baseline: top-1 agreement
of the next-token argmax and KL(P_base || P_variant). One JSON record per model, variant
and metric (``fp8_top1_agreement`` / ``fp8_mean_kl``, ``config.variant``).

Variants (compute dtype float32 unless named ``-bf16``; baseline: the checkpoint's weights
in float32, or the bf16 engine for ``*-vs-bf16``):

* ``bf16-weights``     weights rounded to bf16 — the noise floor of weight rounding alone;
* ``bf16``             the bf16 engine (bf16 weights, activations, KV cache);
* ``fp8-tensor``       e4m3 weights, one absmax scale per projection (vLLM's on-load default);
* ``fp8-channel``      one scale per output channel (``quantization="fp8"``);
* ``fp8-g128`` / ``fp8-g32``  one scale per output channel and 128 / 32 input rows
                       (gcd with K: SmolLM2's K = 576 gets 64 for 128);
* ``fp8-channel-bf16-vs-bf16``  ``quantization="fp8"`` in the bf16 engine against the bf16
                       engine: the issue's "FP8 against bf16" as deployed on a GPU;
* ``fp8err-<f>``       the checkpoint's weights moved a fraction ``f`` of the way to their
                       per-channel e4m3 values (``w + f * (dequant(q) - w)``; ``fp8err-1`` is
                       ``fp8-channel``'s weights): how top-1 agreement and KL scale with the
                       size of the weight error, i.e. what error a format must stay under
                       for a given agreement;
* ``fp8keep-<spec>``   ``fp8err-1`` (per-channel e4m3 weights, W8A16 math) except the
                       projections / layers of :func:`keep_spec` (e.g. ``fp8keep-w_down``,
                       ``fp8keep-L0+L-1``), which keep the checkpoint's values: where the
                       FP8 error comes from, and what a mixed-precision "ignore" list (as
                       compressed-tensors checkpoints carry) would buy; the records give
                       ``kept_weight_fraction`` (of the projection weights);
* ``fp8-gptq``         ``fp8-channel``'s layout and scales, each e4m3 value chosen by GPTQ
                       (jaxinfer/quantization_gptq.py: error compensation through the
                       inverse Hessian of each projection's calibration inputs, sequential,
                       act order, 1 % damping, 128-row blocks) instead of round-to-nearest.
                       Calibration text: ``--calib-windows`` (8) windows of ``--window``
                       tokens of the same text, disjoint from the evaluated tokens: their
                       starts evenly spaced from token ``--positions`` to the last full
                       window (:func:`calibration_windows`; the records list the starts);
                       ``fp8-gptq-noact`` quantizes rows in their stored order;
* ``<fp8 variant>~<seed>``  the same layout, each scale chosen so that its absmax lands on
                       a random one of the e4m3 values 256, 288, ..., 448 instead of 448
                       (still exact; the grid sits elsewhere for the other weights): an
                       equally good realization of the scheme. Their spread is the resolution
                       of any comparison between layouts.

The ``fp8-*`` variants are W8A16 (the weight widened inside an XLA GEMM). Two more prefixes
run the same per-channel weights as W8A8, the math of the GPU engine's Pallas GEMMs
(``pallas_kernels.matmul.fp8_plan.fp8_engine_linear``: each activation row quantized to e4m3 with
absmax/448 scale by ``quantize_rows_fp8``, FP8 x FP8 dot with float32 accumulation, both
scales after) computed by XLA on the CPU: the engine runs with ``matmul_backend="pallas"``
and ``fp8_plan.fp8_engine_plan`` patched to answer the ``"xla"`` backend:

* ``w8a8-channel[...]``   every projection W8A8, at every row count (per-token scales make
                       each row's result independent of the others: what decode computes);
* ``gpuplan-channel[...]`` the activation format the real ``fp8_engine_plan`` picks per GEMM
                       (W8A8 at <= 64 rows and at >= 512 where the Mosaic kernel takes
                       N, K; else W8A16), with the prefill in programs of the engine's default
                       ``max_num_batched_tokens`` (512) rows: a teacher-forced prefill of each
                       window as the GPU engine runs it. Its records carry ``config.gemm_plan``.

``--w8a8`` runs the W8A16 / W8A8 side-by-side set (``W8A8_VARIANTS``).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import record  # noqa: E402

DEFAULT_VARIANTS = ["bf16-weights", "bf16", "fp8-tensor", "fp8-channel", "fp8-g128", "fp8-g32",
                    "fp8-channel-bf16-vs-bf16"] + [f"fp8-{layout}~{seed}" for layout in
                                                   ("channel", "g128", "g32") for seed in (0, 1)]
W8A8_VARIANTS = ["bf16"] + [f"{a}-channel{s}" for s in ("", "~0", "~1")
                             for a in ("fp8", "w8a8")] + \
    ["gpuplan-channel"] + [f"{a}-channel-bf16-vs-bf16" for a in ("fp8", "w8a8", "gpuplan")]
GROUPS = {"fp8-tensor": "tensor", "fp8-channel": None, "fp8-g128": 128, "fp8-g32": 32}
ACTS = {"w8a8": "all", "gpuplan": "plan"}  # variant prefix -> activation mode (else W8A16)
GPTQ = {"fp8-gptq": True, "fp8-gptq-noact": False}  # variant -> act_order
CALIB_WINDOWS = 8


def _text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def calibration_windows(ids: list[int], start: int, window: int, n: int) -> list[int]:
    """Starts of ``n`` windows of ``window`` tokens of ``ids`` evenly spaced from token
    ``start`` to the last full window: all in ``[start, len(ids))``, so disjoint from the
    evaluated ``ids[:start]``. Raises ValueError when the text is too short for them."""
    last = len(ids) - window
    if n < 1 or last < start + (n - 1) * window:
        raise ValueError(f"{n} calibration windows of {window} tokens do not fit in tokens "
                         f"{start}..{len(ids)}")
    return [start + j * (last - start) // max(n - 1, 1) for j in range(n)]


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _quantize(w: np.ndarray, layout: int | str | None, seed: int | None):
    """One layer [K, N] -> (e4m3, scale) as jaxinfer.quantization lays them out; ``tensor``
    gives the per-channel layout with one shared scale; ``seed`` shifts every scale by 2^u."""
    import jax
    import jax.numpy as jnp

    from jaxinfer.quantization import FP8, FP8_MAX, quantize_fp8_weight

    w = jnp.asarray(w, jnp.float32)
    if layout == "tensor":
        s = jnp.full((w.shape[1],), jnp.abs(w).max() / FP8_MAX, jnp.float32)
    else:
        q, s = quantize_fp8_weight(w, layout)
        if seed is None:
            return q, s  # exactly what quantization="fp8" (group_size=layout) makes
    if seed is not None:  # each scale's absmax -> a random e4m3 value in [256, 448], exactly
        key = jax.random.fold_in(jax.random.key(seed), w.size + w.shape[1])
        top = jax.random.choice(key, jnp.arange(256.0, 449.0, 32.0), s.shape)
        s = s * FP8_MAX / top
    full = s if s.ndim == 1 else jnp.repeat(s, w.shape[0] // s.shape[0], axis=0)
    return jnp.clip(w / full, -FP8_MAX, FP8_MAX).astype(FP8), s


def keep_spec(spec: str, num_layers: int):
    """``fp8keep-<spec>``: "+"-joined projection names (``wq wk wv wo w_gate w_up w_down``)
    and layer ranges (``L3``, ``L0:2`` = layers 0-1, negative from the end: ``L-1``) -> a
    predicate ``keep(projection, layer)``: that weight stays at checkpoint precision, all
    others get their per-channel e4m3 values (W8A16 math, as ``fp8err-1``). A projection
    and a range in one spec keep their intersection. Raises ValueError naming a bad part."""
    names, layers = set(), set()
    for part in spec.split("+"):
        if part.startswith("L"):
            a, colon, b = part[1:].partition(":")
            try:
                lo = int(a) % num_layers
                hi = (int(b) % num_layers or num_layers) if colon else lo + 1
            except ValueError:
                raise ValueError(f"fp8keep-{spec}: bad layer range {part!r}") from None
            layers.update(range(lo, hi))
        elif part in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"):
            names.add(part)
        else:
            raise ValueError(f"fp8keep-{spec}: {part!r} is neither a projection nor L<range>")
    return lambda proj, i: (not names or proj in names) and (not layers or i in layers)


@contextlib.contextmanager
def act_quant(mode: str | None, plan_log: dict[str, str]):
    """Within: the FP8 projections of an engine built with ``matmul_backend="pallas"`` run on
    XLA, W8A8 for mode ``"all"``, as the real ``fp8_engine_plan`` says for ``"plan"``; each
    traced GEMM is logged as ``plan_log["MxKxN"] = "W8A8" | "W8A16"``. JAX's trace caches
    are cleared on entry and exit: the engine's FP8 GEMMs sit under a module-level ``jit``
    (transformer._fp8_kernel_linear), whose traces would outlive the patch."""
    if mode is None:
        yield
        return
    import jax

    from pallas_kernels.matmul import fp8_plan

    real = fp8_plan.fp8_engine_plan

    def plan(M: int, K: int, N: int) -> tuple[str, bool]:
        aq = mode == "all" or real(M, K, N)[1]
        plan_log[f"{M}x{K}x{N}"] = "W8A8" if aq else "W8A16"
        return "xla", aq

    jax.clear_caches()
    fp8_plan.fp8_engine_plan = plan
    try:
        yield
    finally:
        fp8_plan.fp8_engine_plan = real
        jax.clear_caches()


def variant_model(loaded, variant: str, calibration: list[list[int]] | None = None,
                  info: dict | None = None):
    """(LoadedModel, engine dtype, baseline, activation mode) for a variant name (see the
    module docstring; mode ``None``: W8A16). ``fp8-gptq*`` needs ``calibration`` (token-id
    windows) and puts its per-layer output errors into ``info["gptq_errors"]``."""
    import ml_dtypes

    from jaxinfer.loading import LoadedModel
    from jaxinfer.models.params import FP8_PROJECTIONS

    name, _, seed = variant.partition("~")
    if name in GPTQ:
        from jaxinfer.quantization_gptq import quantize_model_gptq

        if seed or not calibration:
            raise ValueError(f"{variant}: GPTQ needs calibration windows and takes no ~seed")
        res = quantize_model_gptq(loaded, calibration, act_order=GPTQ[name],
                                  log=lambda line: print(line, file=sys.stderr, flush=True))
        if info is not None:
            info["gptq_errors"] = res.errors
        return (LoadedModel(loaded.config, res.params, loaded.tokenizer, loaded.source),
                "float32", "float32", None)
    act = ACTS.get(name.partition("-")[0])
    if act is not None:
        name = "fp8-" + name.partition("-")[2]
        if isinstance(GROUPS[name.removesuffix("-bf16-vs-bf16")], int):
            raise ValueError(f"{variant}: W8A8 runs per-channel scales only (the kernels')")
    if name == "bf16":
        return loaded, "bfloat16", "float32", None
    params = dict(loaded.params)
    if name.startswith(("fp8err-", "fp8keep-")):
        keep = keep_spec(name.partition("-")[2], loaded.config.num_layers) \
            if name.startswith("fp8keep-") else None
        frac = 1.0 if keep else float(name.partition("-")[2])
        kept = total = 0
        for k in FP8_PROJECTIONS:
            layers = []
            for i, w in enumerate(params[k]):
                q, sc = _quantize(w, None, None)
                deq = np.asarray(q, np.float32) * np.asarray(sc)[None, :]
                f = 0.0 if keep and keep(k.rpartition(".")[2], i) else frac
                layers.append(w + np.float32(f) * (deq - w))
                kept, total = kept + (f == 0.0) * w.size, total + w.size
            params[k] = np.stack(layers).astype(np.float32)
        if info is not None and keep:
            info["kept_weight_fraction"] = kept / total
        return (LoadedModel(loaded.config, params, loaded.tokenizer, loaded.source), "float32",
                "float32", None)
    if name == "bf16-weights":
        for k in FP8_PROJECTIONS + ("embed",):
            params[k] = params[k].astype(ml_dtypes.bfloat16).astype(np.float32)
    else:
        layout = GROUPS[name.removesuffix("-bf16-vs-bf16")]
        for k in FP8_PROJECTIONS:
            qs = [_quantize(params[k][i], layout, int(seed) if seed else None)
                  for i in range(params[k].shape[0])]
            params[k] = np.stack([np.asarray(q) for q, _ in qs])
            params[k + "_scale"] = np.stack([np.asarray(s) for _, s in qs])
    dtype = "bfloat16" if name.endswith("-bf16-vs-bf16") else "float32"
    base = "bfloat16" if name.endswith("-vs-bf16") else "float32"
    return LoadedModel(loaded.config, params, loaded.tokenizer, loaded.source), dtype, base, act


def evaluate(model: str, variants: list[str], positions: int, window: int,
             calib_windows: int = CALIB_WINDOWS):
    """Yield (variant, baseline, metrics) for each variant; GPTQ variants' metrics carry
    ``calibration_starts`` (token offsets of their calibration windows)."""
    from jaxinfer.loading import load_model

    loaded = load_model(model, progress=False)
    text = loaded.tokenizer.encode(_text())
    starts = calibration_windows(text, positions, window, calib_windows) \
        if any(v.partition("~")[0] in GPTQ for v in variants) else []
    calib = [text[s:s + window] for s in starts]
    for v, base, r in compare(loaded, text[:positions], variants, window, calib):
        yield v, base, {**r, **({"calibration_starts": starts} if "gptq_errors" in r else {})}


def compare(loaded, ids: list[int], variants: list[str], window: int,
            calibration: list[list[int]] | None = None):
    """Yield (variant, baseline, metrics) for each variant on the token ids ``ids``
    (``calibration``: token-id windows for the GPTQ variants)."""
    from jaxinfer import LLM
    from jaxinfer.config import EngineConfig

    def logprobs(m, dtype: str, act: str | None = None, plan_log=None) -> np.ndarray:
        chunk = EngineConfig.max_num_batched_tokens if act == "plan" else 256
        kw = dict(max_model_len=window, max_num_seqs=1, max_num_batched_tokens=chunk)
        with act_quant(act, plan_log):
            llm = LLM(m, dtype=dtype, **kw, **({"matmul_backend": "pallas"} if act else {}))
            out = np.concatenate([
                _log_softmax(llm.engine.prompt_logits(ids[s:s + window]).astype(np.float64))
                .astype(np.float32) for s in range(0, len(ids), window)])
        if act and not plan_log:  # the hook must have seen every FP8 GEMM
            raise RuntimeError("fp8_engine_plan was never called: W8A8 not measured")
        return out

    bases: dict[str, np.ndarray] = {}
    for v in variants:
        info: dict = {}
        m, dtype, base, act = variant_model(loaded, v, calibration, info)
        if base not in bases:
            bases[base] = logprobs(loaded, base)
        plan_log: dict[str, str] = {}
        a, b = bases[base], logprobs(m, dtype, act, plan_log)
        kl = np.concatenate([(np.exp(x) * (x - y)).sum(-1) for x, y in
                             zip(np.split(a.astype(np.float64), range(128, len(a), 128)),
                                 np.split(b.astype(np.float64), range(128, len(b), 128)))])
        yield v, base, {"positions": len(a),
                        "top1_agreement": float((a.argmax(-1) == b.argmax(-1)).mean()),
                        "mean_kl": float(kl.mean()), "p99_kl": float(np.quantile(kl, 0.99)),
                        **({"gemm_plan": plan_log} if act == "plan" else {}), **info}


def _activations(variant: str) -> str:
    act = ACTS.get(variant.partition("-")[0])
    if act == "all":
        return "fp8 e4m3 per token (W8A8)"
    if act == "plan":
        return "fp8_engine_plan per GEMM (W8A8 at <= 64 and >= 512 rows where the kernel fits)"
    return "float (W8A16)" if variant.startswith("fp8-") else "float"


def _report_gptq(m: str, v: str, r: dict, cfg: dict) -> None:
    """Print and record GPTQ's per-layer relative output errors against round-to-nearest's
    (``jaxinfer.quantization_gptq.output_error`` on the calibration inputs)."""
    errs = r["gptq_errors"]
    names = list(errs[0])
    g = {k: [e[k][0] for e in errs] for k in names}
    n = {k: [e[k][1] for e in errs] for k in names}
    ratio = float(np.mean([a / b for k in names for a, b in zip(g[k], n[k])]))
    print(f"{m:>14} {v:>26}  relative output error ||XW-XQ||/||XW|| on the calibration "
          f"inputs, GPTQ / round-to-nearest (mean over layers; layers 0, L/2, L-1):")
    for k in names:
        L = len(g[k])
        picks = ", ".join(f"{g[k][i]:.4f}/{n[k][i]:.4f}" for i in (0, L // 2, L - 1))
        print(f"{'':>42} {k:>9}: {np.mean(g[k]):.4f}/{np.mean(n[k]):.4f}   ({picks})")
    print(f"{'':>42} mean ratio GPTQ/RTN over layers and projections: {ratio:.3f}", flush=True)
    record("fp8_gptq_output_error_ratio", ratio, "fraction",
           {**cfg, "gptq_rel_error": g, "rtn_rel_error": n,
            "meaning": "relative output error ||XW-XQ||_F/||XW||_F per layer on the calibration "
                       "inputs (sequential: layers < l quantized), GPTQ vs round-to-nearest; "
                       "value: mean of GPTQ/RTN over layers and projections"})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["smollm2-135m", "gemma3-270m"])
    ap.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS)
    ap.add_argument("--positions", type=int, default=1024)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--calib-windows", type=int, default=CALIB_WINDOWS,
                    help="calibration windows of --window tokens for the fp8-gptq variants")
    ap.add_argument("--w8a8", action="store_true",
                    help="run W8A8_VARIANTS (W8A16 and W8A8 side by side) instead")
    ns = ap.parse_args()
    if ns.w8a8:
        ns.variants = W8A8_VARIANTS
    print(f"{'model':>14} {'variant':>26} {'baseline':>8} {'positions':>9} {'top-1':>7} "
          f"{'mean KL':>9} {'p99 KL':>8}", flush=True)
    for m in ns.models:
        for v, base, r in evaluate(m, ns.variants, ns.positions, ns.window, ns.calib_windows):
            cfg = {"model": m, "variant": v, "positions": r["positions"], "window": ns.window,
                   "baseline": f"checkpoint weights, {base} engine", "text": "pydoc_data.topics",
                   "activations": _activations(v), **({"gemm_plan": r["gemm_plan"]}
                                                      if "gemm_plan" in r else {}),
                   **({"kept_weight_fraction": r["kept_weight_fraction"]}
                      if "kept_weight_fraction" in r else {})}
            if "calibration_starts" in r:
                cfg["calibration"] = {
                    "text": "pydoc_data.topics", "window": ns.window,
                    "token_starts": r["calibration_starts"],
                    "tokens": len(r["calibration_starts"]) * ns.window,
                    "disjoint_from": f"evaluated tokens 0..{ns.positions}"}
                cfg["gptq"] = {"act_order": GPTQ[v.partition("~")[0]], "damp": 0.01,
                               "block_size": 128, "sequential": "layers and projections"}
            record("fp8_top1_agreement", r["top1_agreement"], "fraction", cfg)
            record("fp8_mean_kl", r["mean_kl"], "nats", {**cfg, "p99_kl": r["p99_kl"]})
            print(f"{m:>14} {v:>26} {base:>8} {r['positions']:>9} {r['top1_agreement']:>7.4f}"
                  f" {r['mean_kl']:>9.5f} {r['p99_kl']:>8.4f}", flush=True)
            if "gptq_errors" in r:
                _report_gptq(m, v, r, cfg)


if __name__ == "__main__":
    main()
