"""Exceptions and input handling shared by the paged-attention kernels."""

import jax.numpy as jnp


class PagedAttentionShapeError(ValueError):
    """Inputs whose shapes or dtypes are inconsistent with each other."""


class PagedAttentionUnsupportedError(NotImplementedError):
    """Valid inputs the Pallas kernel does not handle; fall back to the jnp reference."""


def check_q_and_cache(name: str, q, k_cache, v_cache) -> None:
    """Shared shape checks of the decode and prefill kernels: q [N, Hq, D] against
    k/v caches [L, Hkv, P, ps, D] of one shape and dtype, Hq a multiple of Hkv.

    Raises:
      PagedAttentionShapeError: naming ``name`` and the shapes that do not fit.
    """
    if q.ndim != 3 or k_cache.ndim != 5:
        raise PagedAttentionShapeError(
            f"{name}: q must be [N, Hq, D] and k_cache [L, Hkv, P, ps, D], "
            f"got q{q.shape} k_cache{k_cache.shape}")
    if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise PagedAttentionShapeError(
            f"{name}: k_cache {k_cache.shape}/{k_cache.dtype} and v_cache "
            f"{v_cache.shape}/{v_cache.dtype} differ")
    Hq, D = q.shape[1:]
    if k_cache.shape[-1] != D or Hq % k_cache.shape[1]:
        raise PagedAttentionShapeError(
            f"{name}: q{q.shape} does not fit k_cache{k_cache.shape} "
            f"(head dim must match and Hq must be a multiple of Hkv)")


def scalar_operands(layer, window, k_scale, v_scale, k_dtype, fp8_compute_dtype):
    """The leading scalar operands shared by the decode and prefill kernels.

    Returns ``(operands, static_window, compute_dtype)``: ``operands`` holds ``layer`` and,
    when they are traced or given, ``window`` / ``k_scale`` / ``v_scale`` as [1] arrays (in
    the order the kernels read them); ``static_window`` is the window when it is a Python
    int (then not passed as an operand); FP8 caches compute in ``fp8_compute_dtype``.
    """
    fp8 = k_dtype == jnp.float8_e4m3fn
    compute_dtype = jnp.dtype(fp8_compute_dtype) if fp8 else k_dtype
    static_window = window if isinstance(window, int) else None
    operands = [jnp.asarray(layer, jnp.int32).reshape(1)]
    if static_window is None:
        operands.append(jnp.asarray(window, jnp.int32).reshape(1))
    for sc in (k_scale, v_scale):
        if sc is not None:
            operands.append(jnp.asarray(sc, jnp.float32).reshape(1))
    return operands, static_window, compute_dtype
