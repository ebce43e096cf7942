"""Attention metadata and the attention backend interface (reference jnp or Pallas kernels).

The model calls :meth:`AttentionBackend.__call__` once per layer with the new tokens' q/k/v;
the backend writes k/v into the paged KV cache (slot mapping) and attends through the block
tables. Backends are plain Python objects chosen at trace time; the kernels they call live in
``pallas_kernels/`` beside their jnp references.

FP8 KV cache (``EngineConfig.kv_cache_dtype="fp8"``): pages hold float8_e4m3fn (1 byte per
element, half of bf16) with one ``k_scale`` and one ``v_scale`` per layer, float32 ``[L]``
arrays carried in :class:`KVCache` beside the pages they describe. The write quantizes
``stored = clip(value / scale, -448, 448)`` (448 is e4m3fn's largest finite value; a plain
cast would turn larger values into NaN, since e4m3fn has no infinity) with round-to-nearest;
every read, reference or Pallas, dequantizes ``stored * scale`` with the same layer's scales,
which :meth:`AttentionBackend.__call__` takes from the cache once for both.

Why per-tensor (per-layer) scales and not a dynamic scale per token and head (TensorRT-LLM's
option):

* the Pallas decode and prefill kernels take exactly one scalar ``k_scale`` / ``v_scale`` per
  call: ``k_scale`` folds into the softmax scale and ``v_scale`` into the output, so
  dequantization costs nothing per element. A per-token scale would add a scale load to the
  kernels' inner loop and 8 bytes per token per KV head (6 % of an e4m3 page at D = 64, 3 % at
  D = 128) to every page read;
* it is vLLM's scheme (``k_scale`` / ``v_scale`` per attention layer, read = stored * scale),
  1.0 unless the checkpoint is calibrated, so a checkpoint calibrated for vLLM carries exactly
  these numbers. With scale 1.0 e4m3 keeps 3 mantissa bits (relative rounding error at most
  2^-4) for |x| in [2^-6, 448], subnormals down to 2^-9; measured on SmolLM2 in
  benchmarks/fp8_kv_accuracy.py.

Calibrated scales from a checkpoint are not read yet: FP8 checkpoints for vLLM name them
``model.layers.N.self_attn.k_scale`` / ``.v_scale`` (older ones one ``.kv_scale`` for both;
compressed-tensors ``self_attn.k_proj.output_scale`` / ``v_proj.output_scale``), but such
checkpoints also store FP8 weights (``weight_scale`` / ``input_scale``), which the HF loader
rejects as a whole today. A loader that accepts them passes the scales to
``ModelRunner(kv_scales=...)`` (same meaning: read = stored * scale).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.layers.norm import rms_norm
from jaxinfer.layers.rope import apply_rope
from pallas_kernels.matmul.splitk import SplitKPartials
from pallas_kernels.paged_attention import reference as ref

Scale = jax.Array | float | None


@jax.tree_util.register_dataclass
@dataclass
class AttentionMetadata:
    """Per-step arrays describing where tokens sit in the paged KV cache.

    T is the step's token bucket (prefill: packed tokens of several sequences; decode: one
    token per sequence, T == S), S its sequence bucket, maxp its block-table width.

    Attributes:
      positions: [T] int32 absolute position of each token (0 for padding).
      slot_mapping: [T] int32 ``page * page_size + offset`` where each token's K/V is written;
        padding tokens point into the null page 0.
      seq_ids: [T] int32 row of each token in ``block_tables``; -1 for padding.
      block_tables: [S, maxp] int32 page ids of each sequence (0 = unused / null page).
      seq_lens: [S] int32 context length after this step (0 for padding rows).
      logits_indices: [S] int32 token index whose hidden state gives each row's next-token
        logits (the last scheduled token of the sequence).
    """

    positions: jax.Array
    slot_mapping: jax.Array
    seq_ids: jax.Array
    block_tables: jax.Array
    seq_lens: jax.Array
    logits_indices: jax.Array
    is_prefill: bool = dataclasses.field(metadata=dict(static=True), default=True)


FP8_KV_DTYPE = jnp.float8_e4m3fn


@dataclass(frozen=True)
class KVCache:
    """Device page pool: ``k``/``v`` [L, Hkv, P, page_size, D] (layout in reference.py), or
    one [1, Hkv, P, page_size, D] array per layer (a tuple of L) for unrolled models.

    Per-layer arrays keep each one below 4 GiB (8B bf16 with 36,000 pages: 1.2 GB a layer
    against 38 GB stacked), so the Pallas Triton lowering addresses it with 32-bit offsets;
    a stacked pool past 2^32 bytes makes it use 64-bit offset arithmetic for every K/V tile
    (jax/_src/pallas/triton/lowering.py, ``_compute_offsets_from_indices``). A layer's
    array is read and written as ``[1, ...]`` at layer index 0 (:meth:`layer_view`), so the
    kernels and the reference see the same contract either way. Scanned models keep the
    stacked pool (the layer index is traced).

    ``k_scale`` / ``v_scale``: float32 [L] dequantization scales of an FP8 pool (read =
    stored * scale, module docstring), with per-layer arrays a tuple of L [1] arrays; None
    for a pool in the model dtype. Per layer, because a kernel's operand that is a slice of
    one [L] array is a device copy a layer in XLA:GPU (two ``memcpy32_post`` launches a
    layer, 74 µs of the 8B FP8-KV decode step on an H200; session 23).
    """

    k: Any
    v: Any
    k_scale: jax.Array | None = None
    v_scale: jax.Array | None = None

    @property
    def per_layer(self) -> bool:
        """Whether ``k``/``v`` are tuples of one array per layer."""
        return isinstance(self.k, (tuple, list))

    @property
    def dtype(self) -> Any:
        """The pages' dtype."""
        return (self.k[0] if self.per_layer else self.k).dtype

    @property
    def num_pages(self) -> int:
        return (self.k[0] if self.per_layer else self.k).shape[2]

    def layer_view(self, layer: jax.Array | int) -> tuple[jax.Array, jax.Array, jax.Array | int]:
        """(k, v, index) to read and write ``layer``: the stacked pool and ``layer``, or the
        layer's own [1, ...] arrays and 0 (``layer`` must then be a Python int)."""
        if not self.per_layer:
            return self.k, self.v, layer
        return self.k[layer], self.v[layer], 0

    def with_layer(self, layer: jax.Array | int, k: jax.Array, v: jax.Array) -> KVCache:
        """The cache with ``layer``'s pages replaced by ``k``/``v`` (as from layer_view)."""
        if not self.per_layer:
            return dataclasses.replace(self, k=k, v=v)
        ks, vs = list(self.k), list(self.v)
        ks[layer], vs[layer] = k, v
        return dataclasses.replace(self, k=tuple(ks), v=tuple(vs))

    def layer_scales(self, layer: jax.Array | int) -> tuple[jax.Array | None, jax.Array | None]:
        """(k_scale, v_scale) float32 scalars of ``layer`` (int or traced int32), or
        (None, None) for an unquantized pool."""
        if self.k_scale is None or self.v_scale is None:
            return None, None
        if self.per_layer:  # the layer's own [1] buffer (a reshape, no slice)
            return self.k_scale[layer].reshape(()), self.v_scale[layer].reshape(())
        return self.k_scale[layer], self.v_scale[layer]


jax.tree_util.register_dataclass(KVCache, data_fields=["k", "v", "k_scale", "v_scale"],
                                 meta_fields=[])


def allocate_kv_cache(num_layers: int, num_kv_heads: int, num_pages: int, page_size: int,
                      head_dim: int, dtype: jnp.dtype,
                      kv_scales: tuple[Any, Any] | None = None,
                      per_layer: bool = False) -> KVCache:
    """Zero-filled page pool of ``2 * L * Hkv * P * ps * D`` elements of ``dtype``; with
    ``per_layer`` as one ``[1, Hkv, P, ps, D]`` array per layer (see :class:`KVCache`).

    An FP8 (float8_e4m3fn) pool also gets per-layer ``k_scale`` / ``v_scale`` float32 [L]
    (with ``per_layer`` a tuple of L [1] arrays): ``kv_scales`` = (k_scale, v_scale) when
    given (e.g. calibrated in a checkpoint), else 1.0.

    Raises:
      ValueError: ``kv_scales`` for a pool that is not FP8, or scales that are not [L]
        finite positive numbers.
    """
    if per_layer:
        shape = (1, num_kv_heads, num_pages, page_size, head_dim)
        k = tuple(jnp.zeros(shape, dtype) for _ in range(num_layers))
        v = tuple(jnp.zeros(shape, dtype) for _ in range(num_layers))
    else:
        shape = (num_layers, num_kv_heads, num_pages, page_size, head_dim)
        k, v = jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)
    if jnp.dtype(dtype) != jnp.dtype(FP8_KV_DTYPE):
        if kv_scales is not None:
            raise ValueError(f"kv_scales apply to an FP8 KV cache only; this one is "
                             f"{jnp.dtype(dtype).name}")
        return KVCache(k, v)
    if kv_scales is None:
        kv_scales = (np.ones(num_layers), np.ones(num_layers))
    scales = []
    for name, sc in zip(("k_scale", "v_scale"), kv_scales):
        sc = np.asarray(sc, np.float32)
        if sc.shape != (num_layers,) or not np.all(np.isfinite(sc)) or not np.all(sc > 0):
            raise ValueError(f"{name} must be {num_layers} finite positive numbers (one per "
                             f"layer), got shape {sc.shape}: {sc.ravel()[:4]}")
        scales.append(tuple(jnp.asarray(sc[i:i + 1]) for i in range(num_layers)) if per_layer
                      else jnp.asarray(sc))
    return KVCache(k, v, *scales)


class AttentionBackend:
    """Writes new K/V into the cache and attends. This base class is the jnp reference.

    Subclasses override :meth:`decode` / :meth:`prefill` / :meth:`write` with kernels and
    fall back to the reference where a kernel does not apply.
    """

    name = "reference"

    # k_scale / v_scale: the layer's FP8 scales (float32 scalars), None for unquantized pools.
    def write(self, k_cache: jax.Array, v_cache: jax.Array, layer: jax.Array, k: jax.Array,
              v: jax.Array, slot_mapping: jax.Array, *, k_scale: Scale = None,
              v_scale: Scale = None) -> tuple[jax.Array, jax.Array]:
        """Scatter k/v [T, Hkv, D] into their slots (FP8: quantize with saturation)."""
        return ref.write_kv_ref(k_cache, v_cache, layer, k, v, slot_mapping, k_scale=k_scale,
                                v_scale=v_scale)

    def decode(self, q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, layer: jax.Array,
               md: AttentionMetadata, scale: float, window: jax.Array, *,
               k_scale: Scale = None, v_scale: Scale = None) -> jax.Array:
        """One query per sequence: q [S, Hq, D] -> [S, Hq, D]."""
        return ref.paged_decode_attention_ref(q, k_cache, v_cache, layer, md.block_tables,
                                              md.seq_lens, scale=scale, window=window,
                                              k_scale=k_scale, v_scale=v_scale)

    def prefill(self, q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, layer: jax.Array,
                md: AttentionMetadata, scale: float, window: jax.Array, *,
                k_scale: Scale = None, v_scale: Scale = None) -> jax.Array:
        """Packed ragged causal attention: q [T, Hq, D] -> [T, Hq, D]."""
        return ref.paged_prefill_attention_ref(q, k_cache, v_cache, layer, md.block_tables,
                                               md.seq_lens, md.positions, md.seq_ids,
                                               scale=scale, window=window, k_scale=k_scale,
                                               v_scale=v_scale)

    def attend_qkv(self, qkv: jax.Array, cos: jax.Array, sin: jax.Array, cache: KVCache,
                   layer: jax.Array, md: AttentionMetadata, *, num_heads: int, scale: float,
                   window: jax.Array, bias: tuple[jax.Array, ...] | None = None,
                   q_norm: jax.Array | None = None, k_norm: jax.Array | None = None,
                   eps: float = 1e-6) -> tuple[jax.Array, KVCache]:
        """The layer's attention from its QKV projection: qkv [T, (Hq + 2 Hkv) D] (q's heads,
        then k's, then v's; or a split-K GEMM's ``SplitKPartials`` of it) and RoPE's cos /
        sin [T, D] float32 -> (attention output [T, Hq, D], updated cache). ``bias``: (bq,
        bk, bv) added first (Qwen2); ``q_norm`` / ``k_norm``: [D] per-head RMSNorm weights
        (Qwen3, Gemma 3), epsilon ``eps``. Here in XLA: the partials summed, split, bias,
        norms, :func:`apply_rope` on q and k, then :meth:`__call__`; a backend may do all of
        it in its KV write (PallasAttentionBackend)."""
        if isinstance(qkv, SplitKPartials):
            qkv = qkv.reduce()
        T, D = qkv.shape[0], cos.shape[-1]
        q_size = num_heads * D
        kv_size = (qkv.shape[1] - q_size) // 2
        q, k, v = jnp.split(qkv, [q_size, q_size + kv_size], -1)
        if bias is not None:
            q, k, v = q + bias[0], k + bias[1], v + bias[2]
        q, k, v = q.reshape(T, num_heads, D), k.reshape(T, -1, D), v.reshape(T, -1, D)
        if q_norm is not None:
            q, k = rms_norm(q, q_norm, eps), rms_norm(k, k_norm, eps)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return self(q, k, v, cache, layer, md, scale=scale, window=window)

    def __call__(self, q: jax.Array, k: jax.Array, v: jax.Array, cache: KVCache,
                 layer: jax.Array, md: AttentionMetadata, *, scale: float,
                 window: jax.Array) -> tuple[jax.Array, KVCache]:
        """q [T, Hq, D], k/v [T, Hkv, D] -> (attention output [T, Hq, D], updated cache).

        The write and the read use the same scales: the layer's entries of the cache's own.
        """
        ks, vs = cache.layer_scales(layer)
        kc, vc, index = cache.layer_view(layer)
        kc, vc = self.write(kc, vc, index, k, v, md.slot_mapping, k_scale=ks, v_scale=vs)
        fn = self.prefill if md.is_prefill else self.decode
        out = fn(q, kc, vc, index, md, scale, window, k_scale=ks, v_scale=vs)
        return out, cache.with_layer(layer, kc, vc)


def _is_hopper() -> bool:
    """Whether the first device is an NVIDIA GPU of compute capability 9.x (H100 / H200)."""
    cc = getattr(jax.devices()[0], "compute_capability", "") or ""
    return str(cc).split(".")[0] == "9"


def resolve_backend_name(name: str) -> str:
    """The backend ``name`` selects on this machine: ``"auto"`` is ``"pallas_mgpu"`` on a
    Hopper GPU (the Triton kernels plus the Mosaic GPU prefill kernel for long prefill buckets:
    H200 session 6, TTFT of a 4096-token 8B prompt 101.9 vs 107.4 ms, the same at 128 / 1024),
    ``"pallas"`` on other GPUs and ``"reference"`` elsewhere; other names are returned as they
    are."""
    if name == "auto":
        if jax.default_backend() != "gpu":
            return "reference"
        return "pallas_mgpu" if _is_hopper() else "pallas"
    return name


def get_backend(name: str) -> AttentionBackend:
    """``"reference"``, ``"pallas"``, ``"pallas_decode"`` (decode kernel only),
    ``"pallas_mgpu"`` (``"pallas"`` with the Hopper Mosaic GPU prefill kernel for long prefill
    buckets) or ``"auto"`` (see :func:`resolve_backend_name`).

    ``"pallas"`` off a GPU runs the kernels in Pallas interpret mode (slow; for tests).

    Raises:
      ValueError: for an unknown name.
    """
    name = resolve_backend_name(name)
    if name == "reference":
        return AttentionBackend()
    if name in ("pallas", "pallas_decode", "pallas_mgpu"):  # pallas_decode: jnp prefill
        from jaxinfer.layers.pallas_attention import PallasAttentionBackend

        return PallasAttentionBackend(interpret=jax.default_backend() != "gpu",
                                      prefill_kernel=name != "pallas_decode",
                                      prefill_mgpu=name == "pallas_mgpu")
    raise ValueError(f"unknown attention backend {name!r}; use auto, reference, pallas, "
                     f"pallas_decode or pallas_mgpu")
