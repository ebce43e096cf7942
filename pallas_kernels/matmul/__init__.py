"""Linear-layer GEMMs for decode and prefill, bf16 and FP8: jnp references and Pallas kernels.

See :mod:`pallas_kernels.matmul.api` for the engine interface and
benchmarks/kernels/NOTES_matmul.md for designs and H200 measurements.
"""

from pallas_kernels.matmul.api import (
    BACKENDS,
    LinearError,
    PreparedWeight,
    linear,
    linear_supported,
    prepare_gate_up,
    prepare_weight,
)
from pallas_kernels.matmul.reference import (
    gate_up_ref,
    linear_ref,
    quantize_row_groups_fp8,
    quantize_rows_fp8,
    silu_mul_ref,
)

__all__ = [
    "BACKENDS",
    "LinearError",
    "PreparedWeight",
    "gate_up_ref",
    "linear",
    "linear_ref",
    "linear_supported",
    "prepare_gate_up",
    "prepare_weight",
    "quantize_row_groups_fp8",
    "quantize_rows_fp8",
    "silu_mul_ref",
]
