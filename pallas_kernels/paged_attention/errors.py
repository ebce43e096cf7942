"""Exceptions raised by the paged-attention kernels."""


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
