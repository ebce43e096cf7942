"""Attention backend that runs the Pallas GPU kernels of ``pallas_kernels/paged_attention``.

Decode goes to :func:`paged_decode_attention` and prefill (packed ragged, chunked) to
:func:`paged_prefill_attention` where their ``*_supported`` checks accept the shapes and KV
dtype; unsupported shapes fall back to the jnp reference of the base class. With
``prefill_mgpu`` (backend ``"pallas_mgpu"``, Hopper only; what ``"auto"`` picks there) bf16/f16
prefill goes to the Mosaic GPU varlen kernel of ``prefill_mgpu.py`` instead for buckets of at
least ``MGPU_MIN_TOKENS`` (2048) tokens, and to the Triton kernel below: a static choice per bucket
(``prefill_mgpu_route.mgpu_route``; the Mosaic path's plan and gather cost more than it saves on
short prefills). The Mosaic path falls back to the Triton kernel (``lax.cond``) when the
contexts exceed its gathered K/V buffer of 2 T tokens, compiled in only for buckets whose worst
case can exceed it (module docstring of prefill_mgpu.py). FP8 (e4m3) caches go to the same
kernels with the layer's ``k_scale`` / ``v_scale`` (see attention.py).

Both prefill kernels run under module-level ``jax.jit`` wrappers (``kernel_jit``), so the
unrolled layers of a program lower each kernel once per shape instead of once per layer.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.layers.attention import AttentionBackend, AttentionMetadata, KVCache, Scale
from pallas_kernels.paged_attention import (
    paged_decode_attention,
    paged_decode_attention_supported,
    paged_prefill_attention,
    paged_prefill_attention_supported,
)
from pallas_kernels.paged_attention.kv_write import kv_write_supported, write_kv_pallas
from pallas_kernels.paged_attention.prefill_mgpu import paged_prefill_attention_mgpu
from pallas_kernels.paged_attention.prefill_mgpu_route import (
    mgpu_route,
    paged_prefill_mgpu_supported,
)
from pallas_kernels.paged_attention.rope_kv_write import (
    rope_kv_write_supported,
    rope_write_kv_pallas,
)


def _triton_prefill(q, k_cache, v_cache, layer, block_tables, seq_lens, positions, seq_ids,
                    window, k_scale, v_scale, *, scale: float, interpret: bool,
                    static_layer: int | None) -> jax.Array:
    return paged_prefill_attention(
        q, k_cache, v_cache, static_layer if static_layer is not None else layer,
        block_tables, seq_lens, positions, seq_ids, scale=scale, window=window,
        interpret=interpret, k_scale=k_scale, v_scale=v_scale)


# The Triton prefill kernel under its own jit: one lowering per shape in a program (as the
# Mosaic kernel's _mgpu_prefill_jit and the FP8 GEMMs' _fp8_kernel_linear).
_triton_prefill_jit = jax.jit(_triton_prefill,
                              static_argnames=("scale", "interpret", "static_layer"))


# The KV write on the Pallas kernel (kv_write.write_kv_pallas: one program per token and KV
# head, K and V in one launch, vLLM's reshape_and_cache_flash) instead of XLA's scatters
# (reference.write_kv_ref, KV_WRITE_METHOD "auto": two fusions a layer). Off until timed on
# the GPU (benchmarks/kernels/bench_kv_write.py --methods ...,kernel; profile_decode --patch);
# the same stores either way (tests/kernels/test_kv_write.py).
KV_WRITE_KERNEL = False

# Decode steps of at most ROPE_KV_WRITE_MAX_TOKENS tokens rotate q / k and write K / V in one
# Pallas kernel straight from the QKV output (rope_kv_write.rope_write_kv_pallas) instead of
# XLA's rotation and two scatters (three launches a layer; with Qwen2's QKV bias and Qwen3 /
# Gemma 3's QK norm also theirs). On since session 28: its device check passes at every point
# (check_rope_kv_write.py, H100), CUPTI 1.33-2.42 vs XLA's 2.39-2.88 µs a layer at 1-64
# tokens but 7.11 vs 4.44 at 256 (one Triton program per token and head), and the 8B FP8
# decode step's device busy time drops 82 µs at 1 row and 85 at 64 (H100, session 28) as 90
# and 96 on the H200 (session 26). Prefill keeps XLA's (bench_kv_write's 8b_t4096).
ROPE_KV_WRITE_KERNEL = True
ROPE_KV_WRITE_MAX_TOKENS = 64


class PallasAttentionBackend(AttentionBackend):
    """Pallas decode and prefill kernels. ``interpret=True`` runs the kernels on CPU."""

    name = "pallas"

    def __init__(self, interpret: bool = False, prefill_kernel: bool = True,
                 prefill_mgpu: bool = False, kernel_jit: bool = True):
        self.interpret = interpret
        self.prefill_kernel = prefill_kernel
        self.prefill_mgpu = prefill_mgpu
        self.kernel_jit = kernel_jit  # False: inline per layer (benchmarks/lower_prefill_cuda.py)
        if not prefill_kernel:
            self.name = "pallas_decode"
        elif prefill_mgpu:
            self.name = "pallas_mgpu"

    def write(self, k_cache: jax.Array, v_cache: jax.Array, layer: jax.Array, k: jax.Array,
              v: jax.Array, slot_mapping: jax.Array, *, k_scale: Scale = None,
              v_scale: Scale = None) -> tuple[jax.Array, jax.Array]:
        """k/v [T, Hkv, D] into their slots: the Pallas kernel where :data:`KV_WRITE_KERNEL`
        and the head dim allow, else the base class's scatter."""
        if KV_WRITE_KERNEL and kv_write_supported(k_cache.shape[-1]):
            return write_kv_pallas(k_cache, v_cache, layer, k, v, slot_mapping, k_scale,
                                   v_scale, interpret=self.interpret)
        return super().write(k_cache, v_cache, layer, k, v, slot_mapping, k_scale=k_scale,
                             v_scale=v_scale)

    def attend_qkv(self, qkv: jax.Array, cos: jax.Array, sin: jax.Array, cache: KVCache,
                   layer: jax.Array, md: AttentionMetadata, *, num_heads: int, scale: float,
                   window: jax.Array, bias: tuple[jax.Array, ...] | None = None,
                   q_norm: jax.Array | None = None, k_norm: jax.Array | None = None,
                   eps: float = 1e-6) -> tuple[jax.Array, KVCache]:
        """The base class's, with bias, QK norm, RoPE and the KV write in one Pallas kernel on
        decode steps where :data:`ROPE_KV_WRITE_KERNEL`, :data:`ROPE_KV_WRITE_MAX_TOKENS` and
        the head dim allow."""
        kc, vc, index = cache.layer_view(layer)
        if not (ROPE_KV_WRITE_KERNEL and not md.is_prefill
                and qkv.shape[0] <= ROPE_KV_WRITE_MAX_TOKENS
                and rope_kv_write_supported(kc.shape[-1])):
            return super().attend_qkv(qkv, cos, sin, cache, layer, md, num_heads=num_heads,
                                      scale=scale, window=window, bias=bias, q_norm=q_norm,
                                      k_norm=k_norm, eps=eps)
        ks, vs = cache.layer_scales(layer)
        q, kc, vc = rope_write_kv_pallas(kc, vc, index, qkv, cos, sin, md.slot_mapping,
                                         num_heads, ks, vs, bias=bias, q_norm=q_norm,
                                         k_norm=k_norm, eps=eps, interpret=self.interpret)
        out = self.decode(q, kc, vc, index, md, scale, window, k_scale=ks, v_scale=vs)
        return out, cache.with_layer(layer, kc, vc)

    def decode(self, q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, layer: jax.Array,
               md: AttentionMetadata, scale: float, window: jax.Array, *,
               k_scale: Scale = None, v_scale: Scale = None) -> jax.Array:
        ok = paged_decode_attention_supported(q.shape, k_cache.shape, k_cache.dtype)
        # float32 caches (parity runs) also take the kernel up to D = 128 (it spills at 256).
        ok |= (k_cache.dtype == jnp.float32 and q.shape[-1] <= 128
               and paged_decode_attention_supported(q.shape, k_cache.shape, jnp.bfloat16))
        if not (self.interpret or ok):
            return super().decode(q, k_cache, v_cache, layer, md, scale, window,
                                  k_scale=k_scale, v_scale=v_scale)
        return paged_decode_attention(q, k_cache, v_cache, layer, md.block_tables, md.seq_lens,
                                      scale=scale, window=window, interpret=self.interpret,
                                      k_scale=k_scale, v_scale=v_scale)

    def prefill(self, q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, layer: jax.Array,
                md: AttentionMetadata, scale: float, window: jax.Array, *,
                k_scale: Scale = None, v_scale: Scale = None) -> jax.Array:
        # float32 caches (parity runs) take the kernel only in interpret mode: on the GPU its
        # f32 tiles would not fit the tuned shared-memory budget.
        kv = jnp.bfloat16 if self.interpret and k_cache.dtype == jnp.float32 else k_cache.dtype
        if not (self.prefill_kernel and scale > 0
                and paged_prefill_attention_supported(q.shape, k_cache.shape, kv)):
            return super().prefill(q, k_cache, v_cache, layer, md, scale, window,
                                   k_scale=k_scale, v_scale=v_scale)
        # The Mosaic kernel has no interpreter path: on CPU the Triton kernel stands in.
        if self.mgpu_route(q.shape, k_cache.shape, k_cache.dtype, md.block_tables.shape,
                           k_scale is None and v_scale is None) != "triton":
            return paged_prefill_attention_mgpu(q, k_cache, v_cache, layer, md.block_tables,
                                                md.seq_lens, md.positions, md.seq_ids,
                                                scale=scale, window=window,
                                                jit=self.kernel_jit)
        if not self.kernel_jit:
            return paged_prefill_attention(q, k_cache, v_cache, layer, md.block_tables,
                                           md.seq_lens, md.positions, md.seq_ids, scale=scale,
                                           window=window, interpret=self.interpret,
                                           k_scale=k_scale, v_scale=v_scale)
        static_layer = layer if isinstance(layer, int) else None
        return _triton_prefill_jit(q, k_cache, v_cache,
                                   None if static_layer is not None else layer,
                                   md.block_tables, md.seq_lens, md.positions, md.seq_ids,
                                   window, k_scale, v_scale, scale=float(scale),
                                   interpret=self.interpret, static_layer=static_layer)

    def mgpu_route(self, q_shape: tuple, k_cache_shape: tuple, kv_dtype,
                   block_tables_shape: tuple, unscaled: bool = True) -> str:
        """Which prefill kernel this backend lowers for a bucket (static): ``"triton"``,
        ``"mgpu"`` or ``"mgpu_cond"`` (prefill_mgpu_route.mgpu_route), for shapes the Triton kernel
        takes."""
        if not (self.prefill_mgpu and not self.interpret and unscaled
                and paged_prefill_mgpu_supported(q_shape, k_cache_shape, kv_dtype)):
            return "triton"
        (S, maxp), ps = block_tables_shape, k_cache_shape[3]
        return mgpu_route(q_shape[0], S, maxp, ps)
