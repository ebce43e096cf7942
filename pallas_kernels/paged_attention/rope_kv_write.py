"""RoPE and the KV write as one Pallas kernel, straight from the QKV projection's output.

A decode step's layer otherwise runs three XLA fusions between the QKV GEMM and the attention
kernel: q's rotation, and one scatter each for K (rotated) and V (``reference.write_kv_ref``).
Each is a launch of ~2 µs at decode sizes (8B: ~140-210 µs a step over 32 layers, H200
profiles of session 24), and the Pallas KV write alone (``kv_write.write_kv_pallas``) did not
pay, because XLA then materialized the rotated K and the V slice for it. Here one Triton
program per (token, head) reads its head's row from the packed ``[T, (Hq + 2 Hkv) D]`` QKV
output: a query head's program rotates the row and stores it to ``q``; a KV head's program
rotates K, takes V as it is, quantizes both to an FP8 cache's dtype with the layer's scales
and stores them at ``cache[layer, head, slot // ps, slot % ps]`` (vLLM fuses the same pair:
``rotary_embedding`` + ``reshape_and_cache_flash``, and TensorRT-LLM's
``invokeApplyBiasRopeUpdateKVCache``). The caches are aliased to the outputs, as in
``kv_write.py`` (in place when the caller donates them).

The rotation is HF transformers' half layout (``jaxinfer.layers.rope.apply_rope``): with
``c, s`` the first half of the step's ``cos, sin`` rows (``rope_cos_sin`` repeats the
frequencies, so the second half equals the first), ``out[:D/2] = x1 c - x2 s`` and
``out[D/2:] = x2 c + x1 s`` in float32, cast to the QKV dtype, then quantized for the cache
as ``reference.quantize_kv`` does: what ``apply_rope`` followed by ``write_kv_ref`` stores.
With FP8 weights the QKV GEMM at decode sizes splits K and leaves float32 partials
``[S, T, W]`` whose sum, scales and cast XLA would fuse into its consumers (the rotation and
scatters); this kernel takes them as they are (``splitk.SplitKPartials``) and runs that
epilogue itself, so no fusion sits between the GEMM and this kernel.

Optional, in the engine's order before the rotation: the QKV bias (Qwen2) and a per-head
RMSNorm of q and k (Qwen3, Gemma 3), each result rounded to the activation dtype where the
XLA path rounds it (``q + bq``, ``rms_norm``'s output).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.matmul.splitk import SplitKPartials, splitk_epilogue_row
from pallas_kernels.paged_attention.kv_write import kv_write_supported, null_page_slot
from pallas_kernels.paged_attention.reference import quantize_kv


def _kernel(*refs, has_ks: bool, has_vs: bool, has_bias: bool, has_norm: bool, eps: float,
            splits: int, has_xs: bool, has_ws: bool, dtype, P: int, ps: int, D: int, Hq: int,
            Hkv: int):
    it = iter(refs)
    layer_ref, slot_ref = next(it), next(it)
    ks_ref = next(it) if has_ks else None
    vs_ref = next(it) if has_vs else None
    qkv_ref, cos_ref, sin_ref = next(it), next(it), next(it)
    xs_ref = next(it) if has_xs else None  # split-K partials' epilogue scales
    ws_ref = next(it) if has_ws else None
    bias_refs = (next(it), next(it), next(it)) if has_bias else None  # bq, bk, bv
    norm_refs = (next(it), next(it)) if has_norm else None  # q_norm, k_norm
    next(it), next(it)  # the caches as inputs: aliased to the outputs below
    q_ref, kc_ref, vc_ref = next(it), next(it), next(it)
    t, h = pl.program_id(0), pl.program_id(1)
    half = D // 2

    def rounded(x):  # a float32 value as the model's activations hold it
        return x.astype(dtype).astype(jnp.float32)

    def load(col, which, head, start, n):  # row t's n values at col + start (+ bias)
        cols = pl.ds(col + start, n)
        if splits:  # the GEMM's split-K epilogue (SplitKPartials.reduce's order)
            x = splitk_epilogue_row(qkv_ref, xs_ref, ws_ref, t, cols, n, splits, dtype)
        else:
            x = qkv_ref[pl.ds(t, 1), cols].astype(jnp.float32)
        if has_bias:
            b = bias_refs[which][pl.ds(head * D + start, n)].astype(jnp.float32)
            x = rounded(x + b.reshape(1, n))
        return x

    def rotated(col, which, head):  # q (which 0) or k (1) of a head, rotated: two halves
        x1, x2 = load(col, which, head, 0, half), load(col, which, head, half, half)
        if has_norm:  # RMSNorm over the head's D values (jaxinfer.layers.norm.rms_norm)
            ss = jnp.sum(x1 * x1, axis=-1, keepdims=True) + jnp.sum(x2 * x2, axis=-1,
                                                                    keepdims=True)
            inv = jax.lax.rsqrt(ss / D + eps)
            w = norm_refs[which]
            x1 = rounded(x1 * inv * w[pl.ds(0, half)].astype(jnp.float32).reshape(1, half))
            x2 = rounded(x2 * inv * w[pl.ds(half, half)].astype(jnp.float32).reshape(1, half))
        c = cos_ref[pl.ds(t, 1), pl.ds(0, half)]
        s = sin_ref[pl.ds(t, 1), pl.ds(0, half)]
        return (x1 * c - x2 * s).astype(dtype), (x2 * c + x1 * s).astype(dtype)

    @pl.when(h < Hq)
    def _():
        lo, hi = rotated(h * D, 0, h)
        q_ref[pl.ds(t, 1), pl.ds(h, 1), pl.ds(0, half)] = lo.reshape(1, 1, half)
        q_ref[pl.ds(t, 1), pl.ds(h, 1), pl.ds(half, half)] = hi.reshape(1, 1, half)

    @pl.when(h >= Hq)
    def _():
        g = h - Hq
        layer = layer_ref[0]
        page, off = null_page_slot(slot_ref[t], P, ps)

        def put(cache_ref, x, scale_ref, start, n):
            x = quantize_kv(x, None if scale_ref is None else scale_ref[0], cache_ref.dtype)
            cache_ref[pl.ds(layer, 1), pl.ds(g, 1), pl.ds(page, 1), pl.ds(off, 1),
                      pl.ds(start, n)] = x.reshape(1, 1, 1, 1, n)

        lo, hi = rotated((Hq + g) * D, 1, g)
        put(kc_ref, lo, ks_ref, 0, half)
        put(kc_ref, hi, ks_ref, half, half)
        v = load((Hq + Hkv + g) * D, 2, g, 0, D)
        put(vc_ref, v, vs_ref, 0, D)


def rope_kv_write_supported(head_dim: int) -> bool:
    """Whether :func:`rope_write_kv_pallas` takes heads of ``head_dim`` values: a power of two
    whose half is a Triton block (32, 64, 128, 256 and the like)."""
    return head_dim >= 32 and kv_write_supported(head_dim)


def rope_write_kv_pallas(k_cache: jax.Array, v_cache: jax.Array, layer: jax.Array | int,
                         qkv: jax.Array | SplitKPartials, cos: jax.Array, sin: jax.Array,
                         slot_mapping: jax.Array, num_heads: int,
                         k_scale: jax.Array | float | None = None,
                         v_scale: jax.Array | float | None = None, *,
                         bias: tuple[jax.Array, jax.Array, jax.Array] | None = None,
                         q_norm: jax.Array | None = None, k_norm: jax.Array | None = None,
                         eps: float = 1e-6,
                         interpret: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Rotate q and k of the QKV projection's output and write k / v into their pages, one
    Pallas kernel (vLLM's ``rotary_embedding`` + ``reshape_and_cache_flash``). Same values as
    the engine's XLA path: ``+ bias``, per-head ``rms_norm`` of q and k, ``apply_rope``, then
    ``reference.write_kv_ref(method="rows")`` (each step rounded to qkv's dtype as there).

    Args:
      k_cache, v_cache: [L, Hkv, P, ps, D] (bf16 / f16 / f32, or float8_e4m3fn with scales).
      layer: int32 scalar, which layer to write (traced or static).
      qkv: [T, (num_heads + 2 Hkv) * D], q's heads, then k's, then v's (the layout of the
        engine's fused QKV weight), in the activation dtype; T = 0 is a no-op. Or a split-K
        GEMM's ``SplitKPartials`` of it ([S, T, W] float32 partials and their scales),
        summed here in the epilogue's order and rounded to its ``out_dtype``.
      cos, sin: [T, D] float32 rows of ``rope_cos_sin`` (frequencies repeated twice).
      slot_mapping: [T] integer flat slots ``page * ps + offset``; slots other than the null
        page's must not repeat; slots outside ``[0, P * ps)`` land in the null page's slot 0.
      num_heads: query heads Hq (static).
      k_scale, v_scale: FP8 scales (stored = clip(value / scale, ±448)), or None.
      bias: ``(bq [Hq D], bk [Hkv D], bv [Hkv D])`` added to the projection first (Qwen2's
        QKV bias), or None.
      q_norm, k_norm: [D] RMSNorm weights applied per head to q and k before the rotation
        (Qwen3, Gemma 3 with its ``1 + w`` folded in), both or neither; ``eps`` their
        epsilon.
      interpret: run in Pallas interpret mode (CPU tests).
    Returns:
      ``(q, k_cache, v_cache)``: rotated queries [T, Hq, D] in qkv's dtype and the updated
      caches (in place when the caller donates them).
    Raises:
      ValueError: caches not 5-D or differing, a qkv width other than (Hq + 2 Hkv) D, cos /
        sin not [T, D], a slot mapping that is not a 1-D integer array of T slots, a head
        dim :func:`rope_kv_write_supported` does not take, bias or norm weights of other
        lengths (or one norm without the other), split-K partials or scales of other shapes
        (``SplitKPartials.check``), or a static ``layer`` outside ``[0, L)``
        (a traced one is the caller's to keep in range).
    """
    if k_cache.ndim != 5:
        raise ValueError(f"rope_write_kv_pallas: caches must be [L, Hkv, P, ps, D], got "
                         f"{k_cache.shape}")
    L, Hkv, P, ps, D = k_cache.shape
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"rope_write_kv_pallas: k / v caches differ: {k_cache.shape} "
                         f"{k_cache.dtype.name} vs {v_cache.shape} {v_cache.dtype.name}")
    if not rope_kv_write_supported(D):
        raise ValueError(f"rope_write_kv_pallas: head dim {D} is not a power of two >= 32")
    width = (num_heads + 2 * Hkv) * D
    if isinstance(qkv, SplitKPartials):
        qkv.check("rope_write_kv_pallas")
    if len(qkv.shape) != 2 or qkv.shape[1] != width:
        raise ValueError(f"rope_write_kv_pallas: qkv must be [T, {width}] ({num_heads} query "
                         f"+ 2 x {Hkv} KV heads of {D}), got {qkv.shape}")
    T = qkv.shape[0]
    if (slot_mapping.shape != (T,)
            or not jnp.issubdtype(slot_mapping.dtype, jnp.integer)):
        raise ValueError(f"rope_write_kv_pallas: slot_mapping must be a 1-D integer array of "
                         f"{T} slots, got {slot_mapping.shape} {slot_mapping.dtype}")
    if cos.shape != (T, D) or sin.shape != (T, D):
        raise ValueError(f"rope_write_kv_pallas: cos / sin must be [{T}, {D}], got "
                         f"{cos.shape} / {sin.shape}")
    if bias is not None and tuple(b.shape for b in bias) != (
            (num_heads * D,), (Hkv * D,), (Hkv * D,)):
        raise ValueError(f"rope_write_kv_pallas: bias must be (bq [{num_heads * D}], bk "
                         f"[{Hkv * D}], bv [{Hkv * D}]), got {[b.shape for b in bias]}")
    if (q_norm is None) != (k_norm is None) or (
            q_norm is not None and (q_norm.shape, k_norm.shape) != ((D,), (D,))):
        raise ValueError(f"rope_write_kv_pallas: q_norm and k_norm must both be [{D}] or "
                         f"both None, got {getattr(q_norm, 'shape', None)} / "
                         f"{getattr(k_norm, 'shape', None)}")
    if isinstance(layer, (int, np.integer)) and not 0 <= layer < L:
        raise ValueError(f"rope_write_kv_pallas: layer {layer} is outside the cache's {L} "
                         f"layers")
    dtype = qkv.out_dtype if isinstance(qkv, SplitKPartials) else qkv.dtype
    if T == 0:
        return jnp.zeros((0, num_heads, D), dtype), k_cache, v_cache
    norms = None if q_norm is None else (q_norm, k_norm)
    return _rope_write(k_cache, v_cache, layer, qkv, cos, sin, slot_mapping, k_scale, v_scale,
                       bias, norms, num_heads=num_heads, eps=float(eps), interpret=interpret)


@functools.partial(jax.jit, static_argnames=("num_heads", "eps", "interpret"))
def _rope_write(k_cache, v_cache, layer, qkv, cos, sin, slot_mapping, k_scale, v_scale, bias,
                norms, *, num_heads: int, eps: float, interpret: bool):
    L, Hkv, P, ps, D = k_cache.shape
    T = qkv.shape[0]
    scales = [jnp.asarray(s, jnp.float32).reshape(1) for s in (k_scale, v_scale)
              if s is not None]
    split = isinstance(qkv, SplitKPartials)
    epilogue = [a for a in (qkv.x_scale, qkv.w_scale) if a is not None] if split else []
    args = [jnp.asarray(layer, jnp.int32).reshape(1), slot_mapping.astype(jnp.int32),
            *scales, qkv.partials if split else qkv, cos.astype(jnp.float32),
            sin.astype(jnp.float32), *epilogue, *(bias or ()), *(norms or ()), k_cache,
            v_cache]
    dtype = qkv.out_dtype if split else qkv.dtype
    n_caches = len(args) - 2
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    return pl.pallas_call(
        functools.partial(_kernel, has_ks=k_scale is not None, has_vs=v_scale is not None,
                          has_bias=bias is not None, has_norm=norms is not None, eps=eps,
                          splits=qkv.partials.shape[0] if split else 0,
                          has_xs=split and qkv.x_scale is not None,
                          has_ws=split and qkv.w_scale is not None, dtype=dtype,
                          P=P, ps=ps, D=D, Hq=num_heads, Hkv=Hkv),
        out_shape=(jax.ShapeDtypeStruct((T, num_heads, D), dtype),
                   jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
                   jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype)),
        grid=(T, num_heads + Hkv), in_specs=[any_spec] * len(args),
        out_specs=(any_spec,) * 3,
        input_output_aliases={n_caches: 1, n_caches + 1: 2},
        compiler_params=plt.CompilerParams(num_warps=1, num_stages=1),
        interpret=interpret, name="rope_kv_write")(*args)
