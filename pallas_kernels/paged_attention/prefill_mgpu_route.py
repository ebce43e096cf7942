"""Which prefill buckets the ``pallas_mgpu`` backend sends to the Mosaic GPU varlen kernel
(prefill_mgpu.py), and which shapes that kernel takes: plain Python on the bucket's static
shapes (tokens T, block-table rows S, pages per row, page size), decided once per bucket.
Measurements behind the thresholds: benchmarks/kernels/NOTES_paged_prefill.md."""

from __future__ import annotations

import jax.numpy as jnp

# Prefill buckets of fewer tokens take the Triton kernel under "pallas_mgpu": session 5 on the
# H200 (8B, TTFT) measured the Mosaic path 19 % slower at 128 tokens (its plan + gather cost
# more than its faster attention saves) and 4 % faster at 4096 (kernel alone 1.76x Triton);
# session 6 (module-level jit, min 1024): TTFT 1024 tokens 26.86 vs Triton 25.87 ms, 4096
# tokens 101.9 vs 107.4 ms -> the 1024 bucket stays on Triton.
MGPU_MIN_TOKENS = 2048

# Buckets whose worst-case contexts exceed the gathered buffer: "cond" (the Mosaic kernel with
# a lax.cond to the Triton kernel, a host sync per layer on XLA:GPU) or "triton" (the Triton
# kernel, statically). Under the engine's Pallas bucket policy every bucket can overflow, so
# "triton" turns the Mosaic kernel off there.
MGPU_OVERFLOW = "cond"


def paged_prefill_mgpu_supported(q_shape: tuple[int, ...], k_cache_shape: tuple[int, ...],
                                 kv_dtype) -> bool:
    """Whether :func:`paged_prefill_attention_mgpu` takes these shapes: bf16/f16 cache,
    D a multiple of 64 (up to 256), Hq a multiple of Hkv."""
    if len(q_shape) != 3 or len(k_cache_shape) != 5:
        return False
    _, Hq, D = q_shape
    Hkv, Dk = k_cache_shape[1], k_cache_shape[4]
    return (D == Dk and D % 64 == 0 and D <= 256 and Hkv > 0 and Hq % Hkv == 0
            and jnp.dtype(kv_dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)))


def worst_case_context(num_tokens: int, num_seqs: int, max_pages: int, page_size: int) -> int:
    """Largest sum of context lengths in tokens (cached prefix + new) a prefill bucket of
    ``num_tokens`` tokens and ``num_seqs`` block-table rows of ``max_pages`` pages can carry:
    every real row schedules at least one new token (batch.build_step), so at most
    min(S, T) rows are real, and a row's context is at most what its block table addresses.
    Exact for the shapes: min(S, T) rows of one new token each after cached prefixes of
    ``max_pages * page_size - 1`` tokens reach it."""
    return min(num_seqs, num_tokens) * max_pages * page_size


def default_kv_capacity(num_tokens: int, num_seqs: int, max_pages: int, page_size: int) -> int:
    """The gathered buffer's default size in tokens: 2 T, or the bucket's worst case
    (:func:`worst_case_context`) where smaller."""
    return min(2 * num_tokens, worst_case_context(num_tokens, num_seqs, max_pages, page_size))


def mgpu_route(num_tokens: int, num_seqs: int, max_pages: int, page_size: int, *,
               min_tokens: int | None = None, overflow: str | None = None) -> str:
    """The prefill kernel the ``pallas_mgpu`` backend lowers for a bucket (static, per bucket):
    ``"triton"`` below ``min_tokens`` (:data:`MGPU_MIN_TOKENS`) or, with ``overflow``
    (:data:`MGPU_OVERFLOW`) ``"triton"``, where the worst case exceeds the default buffer;
    ``"mgpu"`` where it cannot overflow (no cond); else ``"mgpu_cond"``. Arguments in tokens
    (``num_tokens``, ``page_size``), rows and pages. Raises ValueError for an ``overflow``
    (or :data:`MGPU_OVERFLOW`) other than "cond" / "triton"."""
    min_tokens = MGPU_MIN_TOKENS if min_tokens is None else min_tokens
    overflow = MGPU_OVERFLOW if overflow is None else overflow
    if overflow not in ("cond", "triton"):
        raise ValueError(f"MGPU_OVERFLOW must be 'cond' or 'triton', got {overflow!r}")
    if num_tokens < min_tokens:
        return "triton"
    cap = default_kv_capacity(num_tokens, num_seqs, max_pages, page_size)
    if worst_case_context(num_tokens, num_seqs, max_pages, page_size) <= cap:
        return "mgpu"
    return "mgpu_cond" if overflow == "cond" else "triton"
