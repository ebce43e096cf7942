"""Calibrated FP8 weight quantization: GPTQ error compensation onto the e4m3 per-channel grid.

GPTQ (Frantar, Ashkboos, Hoefler, Alistarh 2022, "GPTQ: Accurate Post-Training Quantization
for Generative Pre-trained Transformers", arXiv 2210.17323; reference implementation
github.com/IST-DASLab/gptq ``gptq.py`` ``GPTQ.fasterquant``) minimises one linear layer's
output error ``||X W - X Q||²`` over calibration inputs ``X [M, K]``: it quantizes one input
row of ``W [K, N]`` at a time and spreads that row's rounding error onto the rows not yet
quantized through the inverse Hessian ``H = 2 XᵀX / M`` (damped by ``damp`` times its mean
diagonal), using the upper Cholesky factor ``U`` of ``H⁻¹``, in lazy blocks of ``block_size``
rows. Rows go in order of decreasing ``H`` diagonal ("act order"; the reference's
``--act-order``) unless ``act_order=False``.

The grid is e4m3 with a **fixed per-output-channel scale**, ``scale[n] = absmax_k |w[k, n]| /
448`` of the original weight, computed by :func:`jaxinfer.quantization.quantize_fp8_per_channel`
before GPTQ runs: the result is stored exactly as ``quantize_fp8_per_channel``'s (e4m3
``[K, N]`` + float32 ``[N]``) and runs on the same kernels. Only which e4m3 value each weight
takes changes. Values that the error updates push past ±448 saturate there.

Whole models (:func:`quantize_model_gptq`) are calibrated sequentially, as in the paper's
driver (``llama.py`` ``llama_sequential`` with ``--true-sequential``): layer ``l``'s inputs
are computed with layers ``< l`` already quantized, and inside a layer each fused projection
(``wqkv``, ``wo``, ``w_gate_up``, ``w_down``; Q/K/V and gate/up share one input, so one
Hessian) sees the layer's earlier projections quantized. Inputs are recorded from the
engine's own ``CausalLM._block`` in float32, jitted, one calibration window at a time: while
the block is traced, a temporary wrapper around ``transformer._proj`` returns the wanted
projection's (normed) input and ends the trace there.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jaxinfer.quantization import (
    FP8_MAX,
    QuantizationError,
    _check_2d,
    quantize_fp8_per_channel,
)

__all__ = ["GPTQModel", "HessianAccumulator", "gptq_fp8", "output_error",
           "quantize_model_gptq"]

_E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
# The fused projections of a layer in the order the block uses them, and their parts.
_ORDER = ("wqkv", "wo", "w_gate_up", "w_down")
_PARTS = {"wqkv": ("wq", "wk", "wv"), "wo": ("wo",), "w_gate_up": ("w_gate", "w_up"),
          "w_down": ("w_down",)}


class HessianAccumulator:
    """Running ``H = 2 XᵀX / M`` (float64 ``[K, K]``) of a layer's inputs, fed in batches.

    ``add(x)`` takes ``x [..., K]`` (any float dtype; leading axes are flattened to rows).
    Raises QuantizationError for inputs whose last axis is not ``K`` or that are not finite.
    """

    def __init__(self, k: int):
        self.k = k
        self.xtx = np.zeros((k, k), np.float64)
        self.rows = 0

    def add(self, x: Any) -> None:
        x = np.asarray(x, np.float64)
        if x.ndim < 1 or x.shape[-1] != self.k:
            raise QuantizationError(f"inputs must be [..., {self.k}], got {x.shape}")
        x = x.reshape(-1, self.k)
        if not np.isfinite(x).all():
            raise QuantizationError("calibration inputs contain NaN or inf")
        self.xtx += x.T @ x
        self.rows += x.shape[0]

    def hessian(self) -> np.ndarray:
        """``2 XᵀX / M`` float64 ``[K, K]``. Raises QuantizationError before any input."""
        if self.rows == 0:
            raise QuantizationError("no calibration inputs were added")
        return self.xtx * (2.0 / self.rows)


def _round(w: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """e4m3 codes of ``w / scale`` (float32 division, round to nearest even, saturating at
    ±448), as quantize_fp8_per_channel rounds."""
    return np.clip(w.astype(np.float32) / scale, -FP8_MAX, FP8_MAX).astype(_E4M3)


def gptq_fp8(w: Any, h: np.ndarray, *, block_size: int = 128, damp: float = 0.01,
             act_order: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """GPTQ-quantize one weight ``w [K, N]`` (used as ``x @ w``) to e4m3 with per-channel scales.

    Args:
      w: float weight ``[K, N]``; K is the input axis GPTQ walks.
      h: the layer's input Hessian ``[K, K]`` (:class:`HessianAccumulator`); only its
        relative size matters. Inputs that never fired (zero diagonal) get a unit diagonal:
        their rows are rounded to nearest and pass no error on (the reference zeroes them;
        here they keep their weights, which unseen text may still use).
      block_size: rows per lazy block update (the reference's 128).
      damp: ``damp * mean(diag(H))`` is added to the diagonal before inverting (1 %).
      act_order: quantize rows in order of decreasing ``diag(H)``.
    Returns:
      ``(q [K, N] float8_e4m3fn, scale [N] float32)`` (numpy) with
      ``w ≈ q.astype(f32) * scale``; ``scale`` is exactly quantize_fp8_per_channel's.
    Raises:
      QuantizationError: ``w`` not a 2-D float array, ``h`` not ``[K, K]``, non-finite
        values, ``block_size < 1``, ``damp`` not in (0, 1], or ``H`` not positive definite
        after damping.
    """
    w32 = jnp.asarray(w)
    _check_2d(w32, "weight")
    K, N = w32.shape
    h = np.array(h, np.float64)
    if h.shape != (K, K):
        raise QuantizationError(f"Hessian must be [{K}, {K}] for a [{K}, {N}] weight, "
                                f"got {h.shape}")
    if not (np.isfinite(h).all() and bool(jnp.isfinite(w32).all())):
        raise QuantizationError("weight and Hessian must be finite")
    if block_size < 1 or not 0.0 < damp <= 1.0:
        raise QuantizationError(f"block_size must be >= 1 and damp in (0, 1], got "
                                f"{block_size}, {damp}")
    scale = np.asarray(quantize_fp8_per_channel(w32.astype(jnp.float32))[1])  # [N] f32
    W = np.array(w32, np.float64)
    dead = np.diag(h) == 0
    h[dead, dead] = 1.0
    perm = np.argsort(-np.diag(h), kind="stable") if act_order else np.arange(K)
    W, h = W[perm], h[perm][:, perm]
    h[np.diag_indices(K)] += damp * np.mean(np.diag(h))
    try:  # U: upper Cholesky factor of H^-1 (the reference's three steps)
        L = np.linalg.cholesky(h)
        hinv = np.linalg.inv(L).T @ np.linalg.inv(L)
        U = np.linalg.cholesky(hinv).T
    except np.linalg.LinAlgError:
        raise QuantizationError("Hessian is not positive definite; raise damp") from None
    Q = np.empty((K, N), _E4M3)
    for i1 in range(0, K, block_size):
        i2 = min(i1 + block_size, K)
        W1, Err = W[i1:i2].copy(), np.empty((i2 - i1, N))  # rows of this block, as updated
        for i in range(i2 - i1):
            q = _round(W1[i], scale)
            Q[i1 + i] = q
            Err[i] = (W1[i] - q.astype(np.float64) * scale) / U[i1 + i, i1 + i]
            W1[i:] -= np.outer(U[i1 + i, i1 + i:i2], Err[i])  # row i: now its q (unused)
        W[i2:] -= U[i1:i2, i2:].T @ Err  # lazy update of the rows after the block
    out = np.empty_like(Q)
    out[perm] = Q
    return out, scale


def output_error(w: Any, q: Any, scale: Any, h: np.ndarray) -> float:
    """Relative output error ``||X W - X Q||_F / ||X W||_F`` of ``Q = q * scale`` on the
    inputs behind ``h`` (``XᵀX`` up to a factor: :meth:`HessianAccumulator.hessian`).
    ``w``/``q`` ``[K, N]``, ``scale [N]``, ``h [K, K]``; returns a float."""
    w = np.asarray(w, np.float64)
    d = w - np.asarray(q).astype(np.float64) * np.asarray(scale, np.float64)
    return float(np.sqrt(np.sum((h @ d) * d) / np.sum((h @ w) * w)))


class GPTQModel(NamedTuple):
    """Result of :func:`quantize_model_gptq`.

    params: the model's params with every projection of ``models.params.FP8_PROJECTIONS``
      float8_e4m3fn ``[L, K, N]`` and its ``*_scale`` float32 ``[L, N]`` (numpy).
    errors: per layer, ``{fused projection: (GPTQ, round-to-nearest)}`` relative output
      errors (:func:`output_error`) on that projection's calibration inputs.
    """

    params: dict[str, np.ndarray]
    errors: list[dict[str, tuple[float, float]]]


class _Captured(Exception):
    """Raised by the recording ``_proj`` once it has the input it waits for."""

    def __init__(self, x: jax.Array):
        super().__init__()
        self.x = x


@contextlib.contextmanager
def _stop_at(target: str) -> Iterator[None]:
    """Within: ``transformer._proj`` raises :class:`_Captured` with the (normed) input of
    the projection ``target`` instead of computing it; restored on exit."""
    from jaxinfer.layers.norm import rms_norm
    from jaxinfer.models import transformer

    real = transformer._proj

    def proj(h, w, name, *args, norm=None, eps=0.0, **kw):
        if name == target:
            raise _Captured(h if norm is None else rms_norm(h, norm, eps))
        return real(h, w, name, *args, norm=norm, eps=eps, **kw)

    transformer._proj = proj
    try:
        yield
    finally:
        transformer._proj = real


class _Window(NamedTuple):
    """One calibration window's inputs to ``CausalLM._block`` besides ``x`` and weights."""

    x0: jax.Array  # [T, H] embedded tokens: layer 0's input
    rope: list[tuple[bool, int, jax.Array, jax.Array]]  # per layer: local_rope, window, cos, sin
    cache: Any  # a one-layer float32 KVCache (each block call writes, then reads, its K/V)
    md: Any  # AttentionMetadata of one sequence at positions 0..T-1


def _window(model: Any, ids: Sequence[int]) -> _Window:
    """Runs ``model.__call__`` with ``CausalLM._block`` replaced by a recorder that passes
    ``x`` through, so embedding and RoPE come from the model's own code."""
    from jaxinfer.layers.attention import AttentionBackend, AttentionMetadata, allocate_kv_cache
    from jaxinfer.models.transformer import CausalLM

    cfg, T, ps = model.cfg, len(ids), 16
    pages = -(-T // ps)
    md = AttentionMetadata(positions=jnp.arange(T, dtype=jnp.int32),
                           slot_mapping=jnp.arange(ps, ps + T, dtype=jnp.int32),
                           seq_ids=jnp.zeros(T, jnp.int32),
                           block_tables=jnp.arange(1, pages + 1, dtype=jnp.int32)[None],
                           seq_lens=jnp.array([T], jnp.int32),
                           logits_indices=jnp.array([T - 1], jnp.int32))
    calls: list[tuple] = []
    real = CausalLM._block

    def record(self, x, cache, w, c, cos, sin, md, attn):
        calls.append((x, bool(c["local_rope"]), int(c["window"]), cos, sin))
        return x, cache

    kv = dict(num_kv_heads=cfg.num_kv_heads, num_pages=pages + 1, page_size=ps,
              head_dim=cfg.head_dim, dtype=jnp.float32, per_layer=True)
    CausalLM._block = record
    try:
        model(jnp.asarray(ids, jnp.int32), allocate_kv_cache(cfg.num_layers, **kv), md,
              AttentionBackend())
    finally:
        CausalLM._block = real
    return _Window(calls[0][0], [c[1:] for c in calls], allocate_kv_cache(1, **kv), md)


def _block_fn(model: Any) -> Any:
    """``f(x, w, win_cache, md, cos, sin, target=, local_rope=, window=)``: one jitted
    ``model._block`` on layer weights ``w``; with ``target`` it returns that projection's
    (normed) input [T, K] instead of the block's output [T, H]."""
    from jaxinfer.layers.attention import AttentionBackend

    def f(x, w, cache, md, cos, sin, *, target, local_rope, window):
        c = {"index": 0, "window": window, "local_rope": local_rope}
        if target is None:
            return model._block(x, cache, w, c, cos, sin, md, AttentionBackend())[0]
        with _stop_at(target):  # active while tracing: the trace ends at the capture
            try:
                model._block(x, cache, w, c, cos, sin, md, AttentionBackend())
            except _Captured as e:
                return e.x
        raise AssertionError(f"_block never called _proj({target!r})")

    return jax.jit(f, static_argnames=("target", "local_rope", "window"))


def quantize_model_gptq(loaded: Any, calibration: Sequence[Sequence[int]], *,
                        block_size: int = 128, damp: float = 0.01, act_order: bool = True,
                        log: Any = None) -> GPTQModel:
    """GPTQ-quantize every layer projection of a loaded model to e4m3 with per-channel scales.

    Args:
      loaded: a ``jaxinfer.loading.LoadedModel`` (or anything with ``config`` and float
        ``params``) whose projections are not quantized yet.
      calibration: token-id windows (each at least 2 tokens, at most the model's
        ``max_position_embeddings``), each run as one sequence from position 0.
      block_size, damp, act_order: as :func:`gptq_fp8`.
      log: optional ``print``-like callable, told each layer's output errors.
    Returns:
      :class:`GPTQModel`: params in exactly the layout ``quantization="fp8"`` produces
      (``benchmarks/fp8_accuracy.py``'s ``fp8-channel``), and per-layer output errors.
    Raises:
      QuantizationError: no calibration window, a window too short or too long, token ids
        out of the vocabulary, or projections already in e4m3.
    """
    from jaxinfer.models.params import FP8_PROJECTIONS
    from jaxinfer.models.transformer import CausalLM, fuse_projections

    cfg, params = loaded.config, loaded.params
    windows = [list(map(int, w)) for w in calibration]
    if not windows:
        raise QuantizationError("no calibration windows")
    for wnd in windows:
        if not 2 <= len(wnd) <= cfg.max_position_embeddings:
            raise QuantizationError(f"calibration windows must have 2..."
                                    f"{cfg.max_position_embeddings} tokens, got {len(wnd)}")
        if min(wnd) < 0 or max(wnd) >= cfg.vocab_size:
            raise QuantizationError(f"calibration token ids must be in [0, {cfg.vocab_size})")
    if any(np.dtype(params[k].dtype) == _E4M3 for k in FP8_PROJECTIONS):
        raise QuantizationError("the model's projections are already FP8")
    model = CausalLM(cfg, params, jnp.float32, scan_layers=False)
    run = _block_fn(model)
    wins = [_window(model, wnd) for wnd in windows]
    xs = [win.x0 for win in wins]  # each window's hidden state before layer l
    out: dict[str, list] = {k: [] for k in FP8_PROJECTIONS}
    errors: list[dict[str, tuple[float, float]]] = []
    for layer in range(cfg.num_layers):
        w = model._layer_weights(f"layer{layer}__")  # fused float32 weights, on the device
        one = fuse_projections({f"layers.{k}": params[f"layers.{k}"][layer]
                                for k in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")})

        def block(i: int, target: str | None) -> jax.Array:
            local, window, cos, sin = wins[i].rope[layer]
            return run(xs[i], w, wins[i].cache, wins[i].md, cos, sin, target=target,
                       local_rope=local, window=window)

        errors.append({})
        for name in _ORDER:  # each sees the layer's earlier projections already quantized
            acc = HessianAccumulator(one[f"layers.{name}"].shape[0])
            for i in range(len(wins)):
                acc.add(block(i, name))
            h, wf = acc.hessian(), one[f"layers.{name}"]
            q, s = gptq_fp8(wf, h, block_size=block_size, damp=damp, act_order=act_order)
            rq, rs = quantize_fp8_per_channel(jnp.asarray(wf, jnp.float32))
            errors[-1][name] = (output_error(wf, q, s, h), output_error(wf, rq, rs, h))
            w[name], w[name + "_scale"] = jnp.asarray(q), jnp.asarray(s)
            sizes = [params[f"layers.{p}"].shape[-1] for p in _PARTS[name]]
            cuts = np.cumsum(sizes)[:-1]
            for p, qp, sp in zip(_PARTS[name], np.split(q, cuts, -1), np.split(s, cuts, -1)):
                out[f"layers.{p}"].append((qp, sp))
        xs = [block(i, None) for i in range(len(wins))]
        if log is not None:
            log(f"layer {layer}: output error GPTQ / round-to-nearest " + ", ".join(
                f"{k} {g:.4f}/{r:.4f}" for k, (g, r) in errors[-1].items()))
    new = dict(params)
    for k, qs in out.items():
        new[k] = np.stack([q for q, _ in qs])
        new[k + "_scale"] = np.stack([s for _, s in qs]).astype(np.float32)
    return GPTQModel(new, errors)
