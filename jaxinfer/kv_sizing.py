"""How many KV pages the device pool gets (vLLM's ``gpu_memory_utilization`` sizing).

On an accelerator, after the weights are on the device::

    kv_budget = gpu_memory_utilization * bytes_limit - bytes_in_use - activation_bytes
    num_pages = (kv_budget - scale_bytes) // page_bytes    (the null page 0 included)
    page_bytes = 2 (K, V) * L * Hkv * page_size * D * itemsize(KV dtype)

The KV dtype is ``EngineConfig.kv_cache_dtype``: the model dtype ("auto") or float8_e4m3fn
("fp8" / "fp8_e4m3"; 1 byte, so twice the pages of bf16 in the same budget, plus
``scale_bytes`` = 2 * L * 4 for the per-layer float32 k/v scales, see layers/attention.py).

``bytes_limit`` / ``bytes_in_use`` come from ``jax.Device.memory_stats()`` (XLA's allocator:
``bytes_limit`` is itself ``XLA_PYTHON_CLIENT_MEM_FRACTION``, default 0.75, of the device's
memory, or all of it with ``XLA_PYTHON_CLIENT_PREALLOCATE=false``); ``bytes_in_use`` holds
the weights; ``activation_bytes`` is the larger temporary-buffer size XLA reports
(``compiled.memory_analysis().temp_size_in_bytes``) for the largest prefill and the largest
decode bucket, compiled against a 2-page pool (temporaries do not depend on the pool size;
vLLM measures the same thing with a profiling forward pass).

On the CPU (``memory_stats()`` is None) the pool is what ``max_num_seqs`` sequences of
``max_model_len`` tokens need (``EngineConfig.total_kv_pages``), capped by
``gpu_memory_utilization`` of the host's available RAM. An explicit ``num_kv_pages`` wins
everywhere. A pool that cannot hold one ``max_model_len`` sequence is a ConfigError.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

from jaxinfer.config import KV_CACHE_DTYPES, ConfigError, EngineConfig, ModelConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVSizing:
    """The sized pool: ``num_pages`` pages (null page included) of ``page_size`` tokens,
    ``page_bytes`` bytes each (K and V, all layers) in ``kv_dtype`` (a numpy dtype name:
    float32, bfloat16, float8_e4m3fn), plus ``scale_bytes`` for the FP8 scales; ``source``
    says how it was chosen; the byte counts are those the decision used (None where not
    applicable)."""

    num_pages: int
    page_size: int
    page_bytes: int
    source: str  # "num_kv_pages" | "device memory" | "max_num_seqs" | "host memory"
    budget_bytes: int | None = None
    weights_bytes: int | None = None
    activation_bytes: int | None = None
    kv_dtype: str = "float32"
    scale_bytes: int = 0

    @property
    def max_tokens(self) -> int:
        """Tokens the pool holds (the null page excluded)."""
        return (self.num_pages - 1) * self.page_size

    @property
    def pool_bytes(self) -> int:
        """Device bytes of the pool: pages plus FP8 scales."""
        return self.num_pages * self.page_bytes + self.scale_bytes

    def describe(self, max_model_len: int) -> str:
        """One start-up log line: KV dtype, pages, page size, tokens that fit, concurrency."""
        gib = 2.0 ** 30
        extra = ""
        if self.budget_bytes is not None:
            extra = f"; budget {self.budget_bytes / gib:.2f} GiB"
            if self.weights_bytes is not None:
                extra += f" after {self.weights_bytes / gib:.2f} GiB in use"
            if self.activation_bytes is not None:
                extra += f" and {self.activation_bytes / gib:.2f} GiB activations"
        return (f"KV cache ({self.source}, {self.kv_dtype}): {self.num_pages - 1} pages x "
                f"{self.page_size} tokens (+ the null page) "
                f"= {self.max_tokens} tokens, {self.pool_bytes / gib:.2f} GiB; max concurrency "
                f"at max_model_len {max_model_len}: {self.max_tokens / max_model_len:.2f}x"
                f"{extra}")


def resolve_kv_dtype(kv_cache_dtype: str, model_dtype: Any) -> np.dtype:
    """The KV pool's dtype for ``EngineConfig.kv_cache_dtype``: ``model_dtype`` for "auto"
    (vLLM's meaning), float8_e4m3fn for "fp8" / "fp8_e4m3". Raises ConfigError otherwise."""
    if kv_cache_dtype == "auto":
        return np.dtype(model_dtype)
    if kv_cache_dtype in ("fp8", "fp8_e4m3"):
        return np.dtype(ml_dtypes.float8_e4m3fn)
    raise ConfigError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got "
                      f"{kv_cache_dtype!r}")


def kv_scale_bytes(model_config: ModelConfig, kv_dtype: Any) -> int:
    """Bytes of the FP8 scales: float32 k_scale and v_scale per layer; 0 unquantized."""
    fp8 = np.dtype(kv_dtype) == np.dtype(ml_dtypes.float8_e4m3fn)
    return 2 * model_config.num_layers * 4 if fp8 else 0


def kv_page_bytes(model_config: ModelConfig, page_size: int, dtype: Any) -> int:
    """Bytes of one page: 2 (K, V) * layers * kv heads * page_size * head_dim * itemsize."""
    c = model_config
    return (2 * c.num_layers * c.num_kv_heads * page_size * c.head_dim
            * np.dtype(dtype).itemsize)


def host_available_bytes() -> int | None:
    """``MemAvailable`` from /proc/meminfo (Linux), else free physical pages; None if
    unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def size_kv_pool(model_config: ModelConfig, ec: EngineConfig, dtype: Any, *,
                 memory_stats: dict[str, int] | None, activation_bytes: int = 0,
                 host_bytes: int | None = None) -> KVSizing:
    """Choose the pool size (module docstring) from numbers measured by the caller.

    Args:
      dtype: the model dtype; the KV dtype follows ``ec.kv_cache_dtype``.
      memory_stats: ``jax.Device.memory_stats()`` of the device that holds the pool (needs
        ``bytes_limit`` and ``bytes_in_use``), or None on the CPU.
      activation_bytes: temporaries of the largest programs (device path only).
      host_bytes: available host RAM in bytes (CPU path), None if unknown (no cap).
    Raises:
      ConfigError: the budget cannot hold one ``max_model_len`` sequence (+ the null page).
    """
    ps = ec.block_size
    kv_dtype = resolve_kv_dtype(ec.kv_cache_dtype, dtype)
    page = kv_page_bytes(model_config, ps, kv_dtype)
    scales = kv_scale_bytes(model_config, kv_dtype)
    pool = functools.partial(KVSizing, page_size=ps, page_bytes=page, kv_dtype=kv_dtype.name,
                             scale_bytes=scales)
    need = ec.max_pages_per_seq + 1
    if ec.num_kv_pages is not None:
        return pool(ec.num_kv_pages, source="num_kv_pages")
    util = ec.gpu_memory_utilization
    if memory_stats is not None and "bytes_limit" in memory_stats:
        limit, in_use = int(memory_stats["bytes_limit"]), int(memory_stats["bytes_in_use"])
        budget = int(util * limit) - in_use - activation_bytes
        sizing = pool(max(0, budget - scales) // page, source="device memory",
                      budget_bytes=budget, weights_bytes=in_use,
                      activation_bytes=activation_bytes)
        if sizing.num_pages < need:
            gib = 2.0 ** 30
            raise ConfigError(
                f"KV cache: gpu_memory_utilization {util} of {limit / gib:.2f} GiB minus "
                f"{in_use / gib:.2f} GiB in use (weights) and {activation_bytes / gib:.2f} GiB "
                f"activations leaves {budget / gib:.2f} GiB = {sizing.num_pages} pages of "
                f"{ps} tokens; one max_model_len ({ec.max_model_len}) sequence needs {need}. "
                f"Raise gpu_memory_utilization, lower max_model_len / max_num_batched_tokens "
                f"/ max_num_seqs, or set num_kv_pages")
        return sizing
    full = ec.total_kv_pages  # max_num_seqs sequences of max_model_len tokens
    if host_bytes is None:
        return pool(full, source="max_num_seqs")
    budget = int(util * host_bytes)
    fit = max(0, budget - scales) // page
    if fit >= full:
        return pool(full, source="max_num_seqs", budget_bytes=budget)
    sizing = pool(fit, source="host memory", budget_bytes=budget)
    if sizing.num_pages < need:
        raise ConfigError(
            f"KV cache: {util} of {host_bytes / 2**30:.2f} GiB available RAM holds "
            f"{sizing.num_pages} pages of {ps} tokens; one max_model_len ({ec.max_model_len}) "
            f"sequence needs {need}. Lower max_model_len or set num_kv_pages")
    return sizing


def profile_activation_bytes(net: Any, ec: EngineConfig, dtype: Any) -> int:
    """Device bytes a step needs besides weights and KV pool, for the largest prefill and
    decode buckets of ``ec`` (max of the two), compiled against a 2-page pool of ``ec``'s KV
    dtype (``dtype``: the model's): the model program's temporaries plus the [S, V] float32
    logits it hands to the sampler, or the all-True sampler program's temporaries plus those
    logits, whichever is larger (see runner.py). Costs three compilations; called only when
    the pool is sized from device memory."""
    from jaxinfer.batch import Bucket
    from jaxinfer.layers.attention import get_backend
    from jaxinfer.runner import SAMPLE, SAMPLER, ModelRunner
    from jaxinfer.sampling import sampler_bucket

    probe = ModelRunner(net, num_pages=2, page_size=ec.block_size,
                        attention=get_backend(ec.attention_backend),
                        kv_dtype=resolve_kv_dtype(ec.kv_cache_dtype, dtype), abstract=True)
    P = ec.page_buckets[-1]
    buckets = [Bucket("prefill", ec.prefill_buckets[-1], ec.prefill_seq_buckets[-1], P),
               Bucket("decode", ec.decode_buckets[-1], ec.decode_buckets[-1], P)]
    S = max(b.num_seqs for b in buckets)
    programs = [(b, SAMPLE) for b in buckets] + [(sampler_bucket(S, "full"), SAMPLER)]
    temps = []
    for b, mode in programs:
        stats = probe.lower(b, mode).compile().memory_analysis()
        logits = b.num_seqs * net.cfg.vocab_size * 4  # returned by one, read by the other
        temps.append(int(getattr(stats, "temp_size_in_bytes", 0) or 0) + logits)
        log.info("activation probe %s %s: %.1f MiB temporaries + logits", mode, b,
                 temps[-1] / 2**20)
    return max(temps)


def size_for_engine(net: Any, model_config: ModelConfig, ec: EngineConfig, dtype: Any
                    ) -> KVSizing:
    """Measure (device memory, activations or host RAM) and size the engine's pool
    (``dtype``: the model dtype; the pool's is ``KVSizing.kv_dtype``)."""
    import jax

    if ec.num_kv_pages is not None:
        return size_kv_pool(model_config, ec, dtype, memory_stats=None)
    stats = jax.devices()[0].memory_stats()
    if stats and "bytes_limit" in stats:
        act = profile_activation_bytes(net, ec, dtype)
        stats = jax.devices()[0].memory_stats()  # after the probe's compilations
        return size_kv_pool(model_config, ec, dtype, memory_stats=stats, activation_bytes=act)
    return size_kv_pool(model_config, ec, dtype, memory_stats=None,
                        host_bytes=host_available_bytes())
