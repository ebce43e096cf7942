"""Paged attention: jnp reference (``reference``) and Pallas GPU kernels."""

from pallas_kernels.paged_attention.reference import (
    paged_decode_attention_ref,
    paged_prefill_attention_ref,
    write_kv_ref,
)

__all__ = ["paged_decode_attention_ref", "paged_prefill_attention_ref", "write_kv_ref"]
