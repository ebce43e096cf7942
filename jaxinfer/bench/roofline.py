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
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from jaxinfer.config import ModelConfig
from jaxinfer.models.params import param_shapes

# Kept equal to jaxinfer.models.transformer.FP8_PROJECTIONS (checked by a test; importing
# it here would pull in JAX).
FP8_PROJECTIONS = ("layers.wq", "layers.wk", "layers.wv", "layers.wo", "layers.w_gate",
                   "layers.w_up", "layers.w_down")
_MATMUL_PARAMS = FP8_PROJECTIONS + ("lm_head",)


def _itemsize(dtype: Any) -> int:
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
             matmul_flops_per_s: float | None = None) -> dict[str, float | None]:
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


def measure_ceilings(matmul_dtype: Any = "bfloat16", repeats: int = 10) -> dict[str, float]:
    """Copy bandwidth (bytes/s: a fused ``x * 2`` over a 4 GiB float32 array, read + write)
    and matmul rate (FLOP/s: 8192^3 in ``matmul_dtype``, the engine's compute dtype) of JAX's
    first device, median of ``repeats`` runs; on the CPU 128 MiB and 512^3, so a smoke run
    stays short. Call it before the engine takes the device's memory."""
    import jax
    import jax.numpy as jnp

    cpu = jax.default_backend() == "cpu"

    def median_s(fn: Any, *args: Any) -> float:
        jax.block_until_ready(fn(*args))
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            ts.append(time.perf_counter() - t0)
        return float(np.median(ts))

    x = jnp.ones((32 if cpu else 1024, 1024 * 1024), jnp.float32)
    copy_s = median_s(jax.jit(lambda a: a * 2), x)
    nbytes = 2 * x.nbytes
    del x
    n = 512 if cpu else 8192
    a = jnp.ones((n, n), matmul_dtype)
    mm_s = median_s(jax.jit(lambda p, q: p @ q), a, a)
    return {"copy_bytes_per_s": nbytes / copy_s, "matmul_flops_per_s": 2 * n ** 3 / mm_s}
