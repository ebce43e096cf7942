"""The KV write as one Pallas kernel: new keys and values into their pages by slot mapping.

vLLM writes a step's K/V with its own CUDA kernel (``reshape_and_cache_flash``: one thread
block per token, every head, quantizing to FP8 on the way); XLA's scatter
(``reference.write_kv_ref``) emits one fusion for K and one for V. Here one Triton program per
(token, KV head) loads the K and V rows of D values, quantizes them to an FP8 cache's dtype
with the layer's scales (``clip(x / scale, ±448)``, as the reference), and stores both into
``cache[layer, head, slot // ps, slot % ps]``. The caches are inputs aliased to the outputs
(``input_output_aliases``): XLA updates them in place when the caller donates them (the
engine's decode and prefill programs do), else copies them first, so the result is always
the functional one.

Slots outside ``[0, P * ps)`` go to the null page's slot 0, as ``write_kv_ref(method="rows")``
does (page 0 is never read). Padding tokens carry slot 0 by the engine's convention.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.paged_attention.reference import quantize_kv


def null_page_slot(slot: jax.Array, P: int, ps: int) -> tuple[jax.Array, jax.Array]:
    """A flat slot's ``(page, offset)``; a slot outside ``[0, P * ps)`` (a caller's bug) goes
    to the null page's slot 0 (``write_kv_ref(method="rows")``'s rule), never into another
    layer's or head's pages."""
    slot = jnp.where((slot >= 0) & (slot < P * ps), slot, 0)
    return slot // ps, slot % ps


def _kernel(*refs, has_ks: bool, has_vs: bool, P: int, ps: int, D: int):
    it = iter(refs)
    layer_ref, slot_ref = next(it), next(it)
    ks_ref = next(it) if has_ks else None
    vs_ref = next(it) if has_vs else None
    k_ref, v_ref = next(it), next(it)
    next(it), next(it)  # the caches as inputs: aliased to the outputs below
    kc_ref, vc_ref = next(it), next(it)
    t, h = pl.program_id(0), pl.program_id(1)
    layer = layer_ref[0]
    page, off = null_page_slot(slot_ref[t], P, ps)

    def put(new_ref, cache_ref, scale_ref):
        x = quantize_kv(new_ref[pl.ds(t, 1), pl.ds(h, 1), pl.ds(0, D)],
                        None if scale_ref is None else scale_ref[0], cache_ref.dtype)
        cache_ref[pl.ds(layer, 1), pl.ds(h, 1), pl.ds(page, 1), pl.ds(off, 1),
                  pl.ds(0, D)] = x.reshape(1, 1, 1, 1, D)

    put(k_ref, kc_ref, ks_ref)
    put(v_ref, vc_ref, vs_ref)


def kv_write_supported(head_dim: int) -> bool:
    """Whether :func:`write_kv_pallas` takes rows of ``head_dim`` values (a power of two, a
    Triton block's length: 64, 128, 256 and the like)."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0


def write_kv_pallas(k_cache: jax.Array, v_cache: jax.Array, layer: jax.Array | int,
                    k_new: jax.Array, v_new: jax.Array, slot_mapping: jax.Array,
                    k_scale: jax.Array | float | None = None,
                    v_scale: jax.Array | float | None = None, *,
                    interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """Write new keys/values into their pages, one Pallas kernel for both (vLLM's
    ``reshape_and_cache_flash``). Same stores as ``reference.write_kv_ref(method="rows")``.

    Args:
      k_cache, v_cache: [L, Hkv, P, ps, D] (bf16 / f16 / f32, or float8_e4m3fn with scales).
      layer: int32 scalar, which layer to write (traced or static).
      k_new, v_new: [T, Hkv, D] new keys / values (any float dtype); T = 0 is a no-op.
      slot_mapping: [T] integer flat slots ``page * ps + offset``; slots other than the null
        page's must not repeat; slots outside ``[0, P * ps)`` land in the null page's slot 0.
      k_scale, v_scale: FP8 scales (stored = clip(value / scale, ±448)), or None.
      interpret: run in Pallas interpret mode (CPU tests).
    Returns:
      The updated caches (in place when the caller donates them).
    Raises:
      ValueError: mismatched shapes, k and v caches of different shapes or dtypes, a head
        dim :func:`kv_write_supported` does not take, a slot mapping that is not a 1-D
        integer array, or a static ``layer`` outside ``[0, L)`` (a traced one is the
        caller's to keep in range: the kernel does not check it).
    """
    if k_cache.ndim != 5:
        raise ValueError(f"write_kv_pallas: caches must be [L, Hkv, P, ps, D], got "
                         f"{k_cache.shape}")
    L, Hkv, P, ps, D = k_cache.shape
    if slot_mapping.ndim != 1 or not jnp.issubdtype(slot_mapping.dtype, jnp.integer):
        raise ValueError(f"write_kv_pallas: slot_mapping must be a 1-D integer array, got "
                         f"{slot_mapping.shape} {slot_mapping.dtype}")
    if isinstance(layer, (int, np.integer)) and not 0 <= layer < L:
        raise ValueError(f"write_kv_pallas: layer {layer} is outside the cache's {L} layers")
    T = slot_mapping.shape[0]
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"write_kv_pallas: k / v caches differ: {k_cache.shape} "
                         f"{k_cache.dtype.name} vs {v_cache.shape} {v_cache.dtype.name}")
    if k_new.shape != (T, Hkv, D) or v_new.shape != (T, Hkv, D):
        raise ValueError(f"write_kv_pallas: k_new / v_new must be [{T}, {Hkv}, {D}] (slots, "
                         f"the cache's KV heads and head dim), got {k_new.shape} / "
                         f"{v_new.shape}")
    if not kv_write_supported(D):
        raise ValueError(f"write_kv_pallas: head dim {D} is not a power of two >= 16")
    if T == 0:
        return k_cache, v_cache
    return _write(k_cache, v_cache, layer, k_new, v_new, slot_mapping, k_scale, v_scale,
                  interpret=interpret)


@functools.partial(jax.jit, static_argnames=("interpret",))
def _write(k_cache, v_cache, layer, k_new, v_new, slot_mapping, k_scale, v_scale, *,
           interpret: bool):
    L, Hkv, P, ps, D = k_cache.shape
    T = slot_mapping.shape[0]
    scales = [jnp.asarray(s, jnp.float32).reshape(1) for s in (k_scale, v_scale)
              if s is not None]
    args = [jnp.asarray(layer, jnp.int32).reshape(1), slot_mapping.astype(jnp.int32),
            *scales, k_new, v_new, k_cache, v_cache]
    n_caches = len(args) - 2
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    return pl.pallas_call(
        functools.partial(_kernel, has_ks=k_scale is not None, has_vs=v_scale is not None,
                          P=P, ps=ps, D=D),
        out_shape=(jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
                   jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype)),
        grid=(T, Hkv), in_specs=[any_spec] * len(args), out_specs=(any_spec, any_spec),
        input_output_aliases={n_caches: 0, n_caches + 1: 1},
        compiler_params=plt.CompilerParams(num_warps=1, num_stages=1),
        interpret=interpret, name="kv_write")(*args)
