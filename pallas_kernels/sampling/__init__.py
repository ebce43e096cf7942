"""Sampling kernels: the exact top-k / top-p threshold search (jnp reference:
``jaxinfer.sampling_filters``)."""

from pallas_kernels.sampling.threshold_search import (
    default_pivots,
    kth_largest,
    nucleus_cut,
)

__all__ = ["default_pivots", "kth_largest", "nucleus_cut"]
