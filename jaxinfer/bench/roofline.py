"""Roofline arithmetic of one decode step: bytes it must move and FLOPs it must compute,
from a :class:`~jaxinfer.config.ModelConfig` alone, and the fraction of the hardware's
measured copy bandwidth and matmul rate that a measured step time achieves.

What is counted (one decode step of B sequences, sequence b attending to ``c_b`` tokens, the
new one included):

* weights read: every parameter in the tensors the step uses -- the projections, norms and
  LM head in full; of the embedding table only the B rows looked up (a tied LM head reads the
  table in full anyway). Under ``quantization="fp8"`` the projections (``FP8_PROJECTIONS``)
  are 1 byte each plus one float32 scale per output channel; embedding, LM head and norms
  stay in the model dtype. :func:`weight_bytes` is the resident total (the whole embedding);
* KV read: K and V of ``min(c_b, sliding_window)`` tokens per layer (sliding-window layers
  read at most the window), ``2 * Hkv * D * kv_itemsize`` bytes per token per layer; KV
  written: the new token's K and V. Whole pages are not rounded up to;
* FLOPs: ``2 * B * (projection + LM head parameters)`` for the GEMMs, and
  ``4 * Hq * D * c_b`` per layer per sequence for attention (QK^T and PV);
* not counted: activations, logits, sampling, the rotary and norm arithmetic (all small at
  decode shapes).

Checked by hand for Llama-3.1-8B in bf16 (tests/bench/test_roofline.py): 8,030,261,248
parameters = 16,060,522,496 bytes resident; a batch-1 decode step reads 15,009,857,536 bytes
of weights (the 1.05 GB embedding table is not read) and 131,072 bytes of KV per context
token.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from jaxinfer.config import ModelConfig
from jaxinfer.models.params import param_shapes

# Kept equal to jaxinfer.models.transformer.FP8_PROJECTIONS (checked by a test; importing
# it here would pull in JAX).
FP8_PROJECTIONS = ("layers.wq", "layers.wk", "layers.wv", "layers.wo", "layers.w_gate",
                   "layers.w_up", "layers.w_down")
_MATMUL_PARAMS = FP8_PROJECTIONS + ("lm_head",)


def _itemsize(dtype: Any) -> int:
    """Bytes per element of a dtype, dtype name ("bfloat16", "float8_e4m3fn") or int."""
    import ml_dtypes  # noqa: F401 - registers bfloat16 / float8 names with numpy

    return dtype if isinstance(dtype, int) else np.dtype(dtype).itemsize


def weight_bytes(cfg: ModelConfig, dtype: Any = "bfloat16", quantization: str | None = None
                 ) -> int:
    """Bytes of every parameter as the device holds them (embedding table in full).

    ``dtype``: the model dtype (name, numpy dtype or itemsize in bytes).
    ``quantization``: None or "fp8" (projections 1 byte + float32 per-channel scales).
    """
    item = _itemsize(dtype)
    total = 0
    for name, shape in param_shapes(cfg).items():
        n = math.prod(shape)
        if quantization == "fp8" and name in FP8_PROJECTIONS:
            total += n + 4 * math.prod(shape[:-2] + shape[-1:])  # [L, K, N]: scales [L, N]
        else:
            total += n * item
    return total


@dataclass(frozen=True)
class StepCost:
    """Bytes and FLOPs of one decode step (see the module docstring for what is counted)."""

    weight_bytes: int
    kv_read_bytes: int
    kv_write_bytes: int
    matmul_flops: int
    attention_flops: int

    @property
    def bytes(self) -> int:
        return self.weight_bytes + self.kv_read_bytes + self.kv_write_bytes

    @property
    def flops(self) -> int:
        return self.matmul_flops + self.attention_flops


def decode_step_cost(cfg: ModelConfig, context_lens: int | Sequence[int], *,
                     batch: int | None = None, dtype: Any = "bfloat16",
                     kv_dtype: Any = None, quantization: str | None = None) -> StepCost:
    """Cost of one decode step.

    Args:
      cfg: the model.
      context_lens: tokens each sequence attends to (new token included): one int for all
        ``batch`` sequences, or one per sequence.
      batch: sequences in the step (only with an int ``context_lens``; default 1).
      dtype: model dtype; ``kv_dtype``: KV cache dtype (default: ``dtype``).
      quantization: None or "fp8".
    Raises:
      ValueError: a context length < 1, an empty batch, or ``batch`` given with a list.
    """
    if isinstance(context_lens, (int, np.integer)):
        ctx = [int(context_lens)] * (1 if batch is None else batch)
    else:
        if batch is not None:
            raise ValueError("give batch only with a single context length")
        ctx = [int(c) for c in context_lens]
    if not ctx or min(ctx) < 1:
        raise ValueError(f"need >= 1 sequence with context >= 1, got {ctx[:8]}")
    B = len(ctx)
    item = _itemsize(dtype)
    kv_item = _itemsize(kv_dtype) if kv_dtype is not None else item
    shapes = param_shapes(cfg)
    w = weight_bytes(cfg, dtype, quantization)
    if "lm_head" in shapes:  # untied: the table is only gathered from
        w -= math.prod(shapes["embed"]) * item
        w += B * cfg.hidden_size * item
    per_tok_layer = 2 * cfg.num_kv_heads * cfg.head_dim * kv_item
    window = cfg.sliding_window or 0
    attended = sum(min(c, window) if kind == "sliding_attention" and window else c
                   for kind in cfg.layer_types for c in ctx)  # token-layers read
    matmul_params = sum(math.prod(shapes[n]) for n in _MATMUL_PARAMS if n in shapes)
    if "lm_head" not in shapes:
        matmul_params += math.prod(shapes["embed"])  # tied LM head
    return StepCost(weight_bytes=w, kv_read_bytes=attended * per_tok_layer,
                    kv_write_bytes=B * cfg.num_layers * per_tok_layer,
                    matmul_flops=2 * B * matmul_params,
                    attention_flops=4 * cfg.num_heads * cfg.head_dim * attended)


def roofline(cost: StepCost, step_s: float, copy_bytes_per_s: float | None = None,
             matmul_flops_per_s: float | None = None) -> dict[str, Any]:
    """Achieved rates of a step of ``cost`` that took ``step_s`` seconds, and their fractions
    of the measured ceilings (None where a ceiling is not given).

    Returns keys ``step_bytes``, ``step_flops``, ``achieved_bytes_per_s``,
    ``achieved_flops_per_s``, ``bandwidth_frac``, ``matmul_frac`` and ``floor_s`` (the larger
    of bytes / bandwidth and FLOPs / matmul rate: the step time the ceilings allow).
    Raises ValueError for a step time that is not positive.
    """
    if not step_s > 0:
        raise ValueError(f"step time must be > 0 s, got {step_s!r}")
    floors = []
    if copy_bytes_per_s:
        floors.append(cost.bytes / copy_bytes_per_s)
    if matmul_flops_per_s:
        floors.append(cost.flops / matmul_flops_per_s)
    return {
        "step_bytes": float(cost.bytes), "step_flops": float(cost.flops),
        "achieved_bytes_per_s": cost.bytes / step_s,
        "achieved_flops_per_s": cost.flops / step_s,
        "bandwidth_frac": cost.bytes / step_s / copy_bytes_per_s if copy_bytes_per_s else None,
        "matmul_frac": cost.flops / step_s / matmul_flops_per_s if matmul_flops_per_s else None,
        "floor_s": max(floors) if floors else None,
    }


def measure_ceilings(matmul_dtype: Any = "bfloat16", repeats: int = 5, calls: int = 10
                     ) -> dict[str, float]:
    """Copy bandwidth and matmul rate of JAX's first device, as the roofline's ceilings.

    Copy: ``-x`` over a 1 GiB float32 array (read + write = 2 GiB moved); matmul: ``y @ a``
    at 8192^3 in ``matmul_dtype`` (the engine's compute dtype). Each is chained ``calls``
    times inside one program (an optimization barrier between calls keeps XLA from fusing
    them), so dispatch and launch gaps do not count, as in
    ``benchmarks/kernels/bench_paged_attention.py``; the median of ``repeats`` runs. On the
    CPU 8 MiB and 512^3, so a smoke run stays short. Returns ``{"copy_bytes_per_s",
    "matmul_flops_per_s"}``. Call it before the engine takes the device's memory.
    """
    import functools

    import jax
    import jax.numpy as jnp

    cpu = jax.default_backend() == "cpu"

    def per_call_s(op: Any, *args: Any) -> float:
        fn = jax.jit(lambda x, *rest: functools.reduce(
            lambda y, _: jax.lax.optimization_barrier(op(y, *rest)), range(calls), x))
        jax.block_until_ready(fn(*args))
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            ts.append(time.perf_counter() - t0)
        return float(np.median(ts)) / calls

    x = jax.random.normal(jax.random.key(0), ((1 << 21) if cpu else (1 << 28),), jnp.float32)
    copy_s = per_call_s(lambda y: -y, x)
    nbytes = 2 * x.nbytes
    del x
    n = 512 if cpu else 8192
    a = (jax.random.normal(jax.random.key(1), (n, n), jnp.float32) / n ** 0.5).astype(
        matmul_dtype)
    mm_s = per_call_s(lambda y, w: y @ w, a, a)
    return {"copy_bytes_per_s": nbytes / copy_s, "matmul_flops_per_s": 2 * n ** 3 / mm_s}
