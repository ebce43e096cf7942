"""Paged attention: jnp reference (``reference``) and Pallas GPU kernels."""

from pallas_kernels.paged_attention.decode import paged_decode_attention
from pallas_kernels.paged_attention.decode_options import paged_decode_attention_supported
from pallas_kernels.paged_attention.errors import (
    PagedAttentionShapeError,
    PagedAttentionUnsupportedError,
)
from pallas_kernels.paged_attention.prefill import (
    paged_prefill_attention,
    paged_prefill_attention_supported,
)
from pallas_kernels.paged_attention.reference import (
    paged_decode_attention_ref,
    paged_prefill_attention_ref,
    write_kv_ref,
)

__all__ = [
    "PagedAttentionShapeError",
    "PagedAttentionUnsupportedError",
    "paged_decode_attention",
    "paged_decode_attention_ref",
    "paged_decode_attention_supported",
    "paged_prefill_attention",
    "paged_prefill_attention_ref",
    "paged_prefill_attention_supported",
    "write_kv_ref",
]
