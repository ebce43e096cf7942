"""Exceptions raised by the paged-attention kernels."""


class PagedAttentionShapeError(ValueError):
    """Inputs whose shapes or dtypes are inconsistent with each other."""


class PagedAttentionUnsupportedError(NotImplementedError):
    """Valid inputs the Pallas kernel does not handle; fall back to the jnp reference."""
