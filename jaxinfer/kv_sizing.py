"""How many KV pages the device pool gets (vLLM's ``gpu_memory_utilization`` sizing).

On an accelerator, after the weights are on the device::

    kv_budget = gpu_memory_utilization * bytes_limit - bytes_in_use - activation_bytes
                - slot_bytes
    num_pages = (kv_budget - scale_bytes) // page_bytes    (the null page 0 included)
    page_bytes = 2 (K, V) * L * Hkv * page_size * D * itemsize(KV dtype)

The KV dtype is ``EngineConfig.kv_cache_dtype``: the model dtype ("auto") or float8_e4m3fn
("fp8" / "fp8_e4m3"; 1 byte, so twice the pages of bf16 in the same budget, plus
``scale_bytes`` = 2 * L * 4 for the per-layer float32 k/v scales, see layers/attention.py).

``bytes_limit`` / ``bytes_in_use`` come from ``jax.Device.memory_stats()``
(:func:`device_memory_stats`; XLA's BFC allocator: ``bytes_limit`` is
``XLA_PYTHON_CLIENT_MEM_FRACTION``, default 0.75, of the device's memory, with or without
``XLA_PYTHON_CLIENT_PREALLOCATE=false``, which only defers the reservation: XLA's
gpu_helpers.cc ``CreateBFCAllocator``); ``bytes_in_use`` holds the weights;
``activation_bytes`` is the larger temporary-buffer size XLA reports
(``compiled.memory_analysis().temp_size_in_bytes``) for the largest prefill and the largest
decode bucket, compiled against a 2-page pool (temporaries do not depend on the pool size;
vLLM measures the same thing with a profiling forward pass). ``jaxinfer compile`` holds no
weights: it passes their bytes from the parameter shapes as ``weights_bytes`` and estimates
the activations from shallow probes (jaxinfer/compile_kv.py).

``slot_bytes`` (:func:`slot_state_bytes`) is the per-sequence state the runner allocates
beside the pool: the penalty token counts, int32 ``[max_num_seqs + 1, vocab_size]``
(0.25 GiB at 512 sequences of Llama 3's 128,256-token vocabulary). A ``max_num_seqs`` whose
state alone exceeds the memory is a ConfigError naming it (a huge value used to end in an
out-of-memory kill).

On the CPU (``memory_stats()`` is None) the pool is what ``max_num_seqs`` sequences of
``max_model_len`` tokens need (``EngineConfig.total_kv_pages``), capped by
``gpu_memory_utilization`` of the host's available RAM less ``slot_bytes``. An explicit
``num_kv_pages`` wins everywhere (if it fits with ``slot_bytes``). A pool that cannot hold
one ``max_model_len`` sequence is a ConfigError.
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
    note: str = ""  # how the numbers were obtained, appended to describe() ("" for none)

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
                f"{extra}" + (f" ({self.note})" if self.note else ""))


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


def device_memory_stats() -> dict[str, int] | None:
    """``memory_stats()`` of the first JAX device (bytes: ``bytes_limit``, ``bytes_in_use``,
    ...), or None where the backend reports none or no ``bytes_limit`` (the CPU). The one place
    both the engine and ``jaxinfer compile`` read device memory (tests replace it)."""
    import jax

    stats = jax.devices()[0].memory_stats()
    return stats if stats and "bytes_limit" in stats else None


def slot_state_bytes(model_config: ModelConfig, ec: EngineConfig) -> int:
    """Bytes of the per-sequence state the runner allocates beside the pool (runner.py): the
    penalty token counts, int32 ``[max_num_seqs + 1, vocab_size]`` (+ the scratch row)."""
    return (ec.max_num_seqs + 1) * model_config.vocab_size * 4


def check_slot_state(model_config: ModelConfig, ec: EngineConfig, room: int | None,
                     where: str) -> int:
    """``slot_state_bytes`` if it fits the ``room`` bytes of ``where`` (None: unknown, no
    check). Raises ConfigError naming max_num_seqs otherwise."""
    slots = slot_state_bytes(model_config, ec)
    if room is not None and slots > room:
        gib = 2.0 ** 30
        raise ConfigError(
            f"max_num_seqs {ec.max_num_seqs}: the per-sequence penalty counts (int32 "
            f"[{ec.max_num_seqs + 1}, {model_config.vocab_size}]) need {slots / gib:,.2f} GiB, "
            f"more than the {max(room, 0) / gib:,.2f} GiB of {where}; lower max_num_seqs"
            + (", or free that memory (an engine sized from device memory takes "
               "gpu_memory_utilization of it for its KV pool: give several engines of one "
               "process num_kv_pages)" if where.startswith("device") else ""),
            field="max_num_seqs")
    return slots


def size_kv_pool(model_config: ModelConfig, ec: EngineConfig, dtype: Any, *,
                 memory_stats: dict[str, int] | None, activation_bytes: int = 0,
                 host_bytes: int | None = None, weights_bytes: int = 0) -> KVSizing:
    """Choose the pool size (module docstring) from numbers measured by the caller.

    Args:
      dtype: the model dtype; the KV dtype follows ``ec.kv_cache_dtype``.
      memory_stats: ``jax.Device.memory_stats()`` of the device that holds the pool (needs
        ``bytes_limit`` and ``bytes_in_use``), or None on the CPU.
      activation_bytes: temporaries of the largest programs (device path only).
      host_bytes: available host RAM in bytes (CPU path), None if unknown (no cap).
      weights_bytes: device bytes of weights not yet in ``bytes_in_use`` (``jaxinfer
        compile``, which loads none; device path only: the caller takes them off
        ``host_bytes`` itself). ``KVSizing.weights_bytes`` is in use plus these.
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
        limit = int(memory_stats["bytes_limit"])
        in_use = int(memory_stats["bytes_in_use"]) + weights_bytes
        slots = check_slot_state(model_config, ec, int(util * limit) - in_use,
                                 f"device memory ({util} of the limit less what is in use: "
                                 f"the weights, and the KV pool of any other engine alive in "
                                 f"this process)")
        budget = int(util * limit) - in_use - activation_bytes - slots
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
    slots = check_slot_state(model_config, ec, int(util * host_bytes),
                             f"available RAM ({util} of it)")
    budget = int(util * host_bytes) - slots
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


def lower_probes(net: Any, ec: EngineConfig, dtype: Any, *, sampler: bool = True
                 ) -> list[tuple[str, Any, int]]:
    """The activation probes of ``ec`` for ``net`` (abstract or not), traced and lowered but
    not compiled: ``(name, jax.stages.Lowered, logits bytes)`` for "prefill" (largest prefill
    bucket), "decode" (largest decode bucket) and, with ``sampler``, "sampler" (the all-True
    sampler program at the larger row count); each against a 2-page pool of ``ec``'s KV dtype
    (``dtype``: the model's) with the widest page bucket. The logits bytes are the
    [S, V] float32 logits the model program returns and the sampler reads."""
    from jaxinfer.batch import Bucket
    from jaxinfer.layers.attention import get_backend
    from jaxinfer.runner import SAMPLE, SAMPLER, ModelRunner
    from jaxinfer.sampling import sampler_bucket

    probe = ModelRunner(net, num_pages=2, page_size=ec.block_size,
                        attention=get_backend(ec.attention_backend),
                        kv_dtype=resolve_kv_dtype(ec.kv_cache_dtype, dtype), abstract=True)
    P = ec.page_buckets[-1]
    buckets = {"prefill": Bucket("prefill", ec.prefill_buckets[-1], ec.prefill_seq_buckets[-1],
                                 P),
               "decode": Bucket("decode", ec.decode_buckets[-1], ec.decode_buckets[-1], P)}
    programs = [(name, b, SAMPLE) for name, b in buckets.items()]
    if sampler:
        S = max(b.num_seqs for b in buckets.values())
        programs.append(("sampler", sampler_bucket(S, "full"), SAMPLER))
    V = net.cfg.vocab_size
    return [(name, probe.lower(b, mode), b.num_seqs * V * 4) for name, b, mode in programs]


def compile_probes(lowered: list[tuple[str, Any, int]], threads: int = 1) -> dict[str, int]:
    """Compile :func:`lower_probes`' programs (``threads`` at a time: XLA compiles outside
    the GIL) and return ``{name: temporaries + logits bytes}``; the executables are dropped."""
    from concurrent.futures import ThreadPoolExecutor

    def temps(item: tuple[str, Any, int]) -> int:
        name, low, logits = item
        stats = low.compile().memory_analysis()
        n = int(getattr(stats, "temp_size_in_bytes", 0) or 0) + logits
        log.info("activation probe %s: %.1f MiB temporaries + logits", name, n / 2**20)
        return n

    if threads <= 1 or len(lowered) <= 1:
        sizes = [temps(item) for item in lowered]
    else:
        with ThreadPoolExecutor(min(threads, len(lowered))) as ex:
            sizes = list(ex.map(temps, lowered))
    return {name: n for (name, _, _), n in zip(lowered, sizes)}


def profile_activation_bytes(net: Any, ec: EngineConfig, dtype: Any) -> int:
    """Device bytes a step needs besides weights and KV pool, for the largest prefill and
    decode buckets of ``ec`` (max of the two), compiled against a 2-page pool of ``ec``'s KV
    dtype (``dtype``: the model's): the model program's temporaries plus the [S, V] float32
    logits it hands to the sampler, or the all-True sampler program's temporaries plus those
    logits, whichever is larger (see runner.py). Costs three compilations, run at once
    (XLA compiles outside the GIL); called only when the pool is sized from device memory."""
    return max(compile_probes(lower_probes(net, ec, dtype), threads=3).values())


def size_for_engine(net: Any, model_config: ModelConfig, ec: EngineConfig, dtype: Any
                    ) -> KVSizing:
    """Measure (device memory, activations or host RAM) and size the engine's pool
    (``dtype``: the model dtype; the pool's is ``KVSizing.kv_dtype``)."""
    if ec.num_kv_pages is not None:
        return _check_fits(size_kv_pool(model_config, ec, dtype, memory_stats=None),
                           model_config, ec)
    stats = device_memory_stats()
    if stats is not None:  # a max_num_seqs too large is refused before its probe compiles
        check_slot_state(model_config, ec, *_memory_left(stats))
        act = profile_activation_bytes(net, ec, dtype)
        stats = device_memory_stats() or stats  # after the probe's compilations
        return size_kv_pool(model_config, ec, dtype, memory_stats=stats, activation_bytes=act)
    return size_kv_pool(model_config, ec, dtype, memory_stats=None,
                        host_bytes=host_available_bytes())


def _check_fits(sizing: KVSizing, model_config: ModelConfig, ec: EngineConfig) -> KVSizing:
    """``sizing`` (an explicit ``num_kv_pages``) if its pool and the per-sequence state
    (:func:`slot_state_bytes`) fit the memory left: the device's XLA limit less what is in
    use (the weights), on the CPU the available RAM. Raises ConfigError otherwise (the
    allocation failed with an out-of-memory traceback, or the kernel killed the process)."""
    free, where = _memory_left(device_memory_stats())
    if free is not None:
        slots = check_slot_state(model_config, ec, free, where)
        free -= slots
        where += f" less {slots / 2.0 ** 30:,.2f} GiB of per-sequence state"
    if free is not None and sizing.pool_bytes > free:
        gib = 2.0 ** 30
        raise ConfigError(
            f"num_kv_pages {sizing.num_pages}: the KV pool needs "
            f"{sizing.pool_bytes / gib:,.2f} GiB ({sizing.page_bytes:,} bytes a page), more "
            f"than the {free / gib:,.2f} GiB of {where}; lower num_kv_pages, or leave it out "
            f"to size the pool from memory")
    return sizing


def _memory_left(stats: dict[str, int] | None) -> tuple[int | None, str]:
    """``(bytes, where)`` not yet in use: the device's XLA limit less what is in use (the
    weights), or without device stats the host's available RAM (None if unknown)."""
    if stats is not None:
        return (int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0)),
                "device memory (XLA's limit less what is in use: the weights, and the KV "
                "pool of any other engine alive in this process)")
    return host_available_bytes(), "available RAM"
