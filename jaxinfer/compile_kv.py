"""The KV pool ``jaxinfer compile`` builds its programs for (the pool's shape is in every one).

Without ``--num-kv-pages`` the compile chooses the pool an engine started on the same device
without the cache would choose (jaxinfer/kv_sizing.py), capped at ``total_kv_pages``
(``max_num_seqs`` sequences of ``max_model_len`` tokens); an engine started later with the cache
adopts it (``LLMEngine``, ``compile.cached_num_kv_pages``):

* device with ``memory_stats()`` (GPU)::

      budget = gpu_memory_utilization * bytes_limit - bytes_in_use - weights - activations
      pages  = min((budget - scale_bytes) // page_bytes, total_kv_pages)

  ``weights``: device bytes of the parameters the engine would hold, from the abstract
  model's shapes and dtypes (:func:`weights_device_bytes`: fused projections, FP8 weights and
  their float32 scales with ``--quantization fp8``); the compile process loads none.
  ``activations``: the engine's probe (``kv_sizing.profile_activation_bytes``) on the
  abstract model, but on shallow copies of it when the model is deeper than the probes
  (:func:`probe_depths`): each model program's temporaries at depths a and b, extended
  linearly to the full depth (:func:`estimate_activation_bytes`). Unrolled layers compile in
  time proportional to depth (about 10 s for the 8B prefill program on an H200, 32 layers,
  benchmarks/RESULTS.md), so the full-depth probes, one after another as the engine runs
  them, would put some 20 s before the first compile; 3- and 4-layer probes, compiled in
  parallel threads, cost a fraction of that and run beside the workers' imports. On the CPU
  (8B shape, bf16, 1024-token prefill, 256-row decode; jnp attention) the prefill program's
  temporaries were 3662.1 MiB at 2 layers and 3678.1 MiB at 3, 4, 5, 8 and 32, the decode
  program's 8971.9 MiB at every depth; with FP8 weights on XLA both grew by the same
  416.0 MiB per layer (prefill 16926.1, decode 22123.9 MiB at 32 layers, the 3- and 4-layer
  values extended: the same). The fit is exact in both; the estimate adds 5 %
  (``EXTEND_MARGIN``) for models whose temporaries grow a little faster than the line (seen
  in a tiny model, 1.6 %); growing slower only makes it high (fewer pages, never more).
  Its cost for 8B activations of 2.46 GiB (an H200 probe, RESULTS.md): 63 pages of 2 MiB.
* CPU (no ``memory_stats()``): ``kv_sizing.size_kv_pool``'s host path, the available RAM
  less the weights the engine will hold there; where the weights alone exceed the RAM (a
  bucket set compiled for another machine), ``total_kv_pages`` with a warning.

A budget that cannot hold one ``max_model_len`` sequence raises ConfigError (size_kv_pool).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

from jaxinfer import kv_sizing
from jaxinfer.config import EngineConfig, ModelConfig
from jaxinfer.kv_sizing import KVSizing, compile_probes, lower_probes, size_kv_pool

log = logging.getLogger("jaxinfer.compile")

PROBE_THREADS = 5  # probe programs compiled at once (the compile process's own threads)
# Extended estimates are raised by this factor: XLA's temporaries are not always affine in
# depth (a tiny 8-layer model on the CPU: 128 B more prefill temporaries per layer up to 5
# layers, then 768, 256, 384: 1.6 % above the line through 3 and 4 layers).
EXTEND_MARGIN = 1.05


def abstract_net(model_config: ModelConfig, ec: EngineConfig, num_layers: int | None = None
                 ) -> Any:
    """The engine's CausalLM for ``ec`` over ShapeDtypeStruct weights (nothing allocated),
    optionally cut to its first ``num_layers`` layers (activation probes)."""
    import jax
    from flax import nnx

    from jaxinfer.engine_config import _resolve_dtype
    from jaxinfer.models.params import param_shapes
    from jaxinfer.models.transformer import CausalLM, model_options

    mc = model_config
    if num_layers is not None and num_layers != mc.num_layers:
        mc = mc.replace(num_layers=num_layers, layer_types=mc.layer_types[:num_layers])
    dtype = _resolve_dtype(ec.dtype)
    shapes = {k: jax.ShapeDtypeStruct(s, dtype) for k, s in param_shapes(mc).items()}
    return nnx.eval_shape(lambda p: CausalLM(mc, p, dtype, **model_options(ec)), shapes)


def weights_device_bytes(net: Any) -> int:
    """Bytes of every array ``net`` (abstract or not) holds: size x itemsize of each leaf of
    ``nnx.state(net)``, i.e. the weights as the engine lays them out on the device (fused
    QKV / gate-up, float8_e4m3fn projections plus their float32 scales under FP8)."""
    import jax
    import numpy as np
    from flax import nnx

    return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize
               for x in jax.tree_util.tree_leaves(nnx.state(net)))


def probe_depths(model_config: ModelConfig) -> tuple[int, int] | None:
    """Depths (a, b) of the shallow activation probes, or None to probe the full model.

    p = the shortest prefix of ``layer_types`` holding every layer type (1 for uniform
    models, 6 for Gemma 3's five sliding layers and one global); a = max(3, p) (2 layers
    measured below the trend on the CPU, see the module docstring), b = a + p (one more
    period of the pattern). None when b reaches the model's depth: the full model is then
    cheap enough."""
    types = model_config.layer_types
    p = 1 + max(types.index(t) for t in set(types))
    a = max(3, p)
    b = a + p
    return None if b >= model_config.num_layers else (a, b)


def estimate_activation_bytes(model_config: ModelConfig, ec: EngineConfig, dtype: Any
                              ) -> tuple[int, str]:
    """(activation bytes, how they were obtained) for the full model: the engine's probes
    (kv_sizing.lower_probes) on the abstract model, or at :func:`probe_depths` (a, b) with
    each model program's bytes extended linearly to L layers and raised by EXTEND_MARGIN,
    ``(m(b) + max(0, m(b) - m(a)) * (L - b) / (b - a)) * 1.05`` (rounded up), and the
    sampler program (no layers) once; the largest of the three."""
    depths = probe_depths(model_config)
    L = model_config.num_layers
    if depths is None:
        sizes = compile_probes(lower_probes(abstract_net(model_config, ec), ec, dtype),
                               PROBE_THREADS)
        return max(sizes.values()), f"activations probed at all {L} layers"
    a, b = depths
    low_a = [(f"{name}@{a}", low, n) for name, low, n
             in lower_probes(abstract_net(model_config, ec, a), ec, dtype, sampler=False)]
    low_b = [(f"{name}@{b}", low, n) for name, low, n
             in lower_probes(abstract_net(model_config, ec, b), ec, dtype)]
    sizes = compile_probes(low_a + low_b, PROBE_THREADS)
    est = {"sampler": sizes.pop(f"sampler@{b}")}
    for name in ("prefill", "decode"):
        ma, mb = sizes[f"{name}@{a}"], sizes[f"{name}@{b}"]
        line = mb + max(0, mb - ma) * (L - b) / (b - a)
        est[name] = math.ceil(line * EXTEND_MARGIN)
    log.info("activation estimate for %d layers from %d- and %d-layer probes: %s", L, a, b,
             ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in est.items()))
    return max(est.values()), f"activations from {a}- and {b}-layer probes, extended to {L}"


def size_for_compile(model_config: ModelConfig, ec: EngineConfig) -> KVSizing:
    """The pool ``jaxinfer compile`` fixes for ``ec`` (module docstring): ``ec.num_kv_pages``
    if set, else sized from device memory (weights from the shapes, activations estimated)
    or, on the CPU, ``total_kv_pages`` capped by the host RAM left after the weights.
    Raises ConfigError when the budget cannot hold one ``max_model_len`` sequence."""
    import numpy as np

    from jaxinfer.engine_config import _resolve_dtype

    dtype = np.dtype(_resolve_dtype(ec.dtype))
    if ec.num_kv_pages is not None:
        return size_kv_pool(model_config, ec, dtype, memory_stats=None)
    weights = weights_device_bytes(abstract_net(model_config, ec))
    # Read through the module: tests replace kv_sizing.device_memory_stats.
    if kv_sizing.device_memory_stats() is None:
        host = kv_sizing.host_available_bytes()
        if host is not None and host <= weights:
            # The weights alone exceed this host's RAM: the programs are compiled here for
            # another machine (a 70B-shaped bucket set on a laptop), so its RAM says nothing
            # about the pool: max_num_seqs full-length sequences, as before the RAM cap.
            log.warning("KV pool: the weights (%.2f GiB) exceed this host's available RAM "
                        "(%.2f GiB): sized for max_num_seqs x max_model_len; pass "
                        "--num-kv-pages for the machine that will run it", weights / 2**30,
                        host / 2**30)
            host = None
        sizing = size_kv_pool(model_config, ec, dtype, memory_stats=None,
                              host_bytes=None if host is None else max(0, host - weights))
        note = (f"of the host RAM less {weights / 2**30:.2f} GiB weights from the parameter "
                f"shapes" if sizing.budget_bytes is not None else "")
        return dataclasses.replace(sizing, note=note)
    act, how = estimate_activation_bytes(model_config, ec, dtype)
    stats = kv_sizing.device_memory_stats()  # after the probes' compiles, as the engine does
    sizing = size_kv_pool(model_config, ec, dtype, memory_stats=stats, activation_bytes=act,
                          weights_bytes=weights)
    note = f"weights {weights / 2**30:.2f} GiB from the parameter shapes; {how}"
    if sizing.num_pages > ec.total_kv_pages:  # more than max_num_seqs full sequences need
        log.info("KV pool: device memory holds %d pages, capped at max_num_seqs x "
                 "max_model_len = %d", sizing.num_pages, ec.total_kv_pages)
        return dataclasses.replace(sizing, num_pages=ec.total_kv_pages, source="max_num_seqs",
                                   note=f"{note}; memory holds {sizing.num_pages - 1} pages")
    return dataclasses.replace(sizing, note=note)
