"""Record the shared-memory byte offsets of the TMA copies a Mosaic GPU kernel issues while it
runs in the Mosaic GPU interpreter (``plgpu.InterpretGPUParams``), so a CPU test can check the
hardware rule the interpreter does not: the shared-memory address of a TMA transfer
(``cp.async.bulk.tensor``) must be 128-byte aligned (CUDA C++ Programming Guide, "Tensor
Memory Access"; a violation is "CUDA error: misaligned address" at run time, which kills the
process's CUDA context).

Pallas Mosaic GPU starts every shared-memory allocation on a 1024-byte boundary
(``jax._src.pallas.mosaic_gpu.core.SMEM_ALIGNMENT``), so a copy is aligned iff its view's
offset inside its allocation is. The offset is computed in the buffer's logical (row-major)
layout, which equals the physical one for views that take whole tiled rows or index leading
axes only — the case in the matmul kernels (pipeline slots, per-warpgroup slices).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import numpy as np
from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
from jax._src.pallas.mosaic_gpu.interpret.shared_memory import HostAllocationKey

TMA_SMEM_ALIGN = 128


@dataclasses.dataclass(frozen=True)
class SmemCopy:
    """One TMA copy seen by the interpreter: direction, the smem buffer's logical shape and
    dtype, and the byte offset of the copied view inside that buffer."""

    direction: str  # "gmem_to_smem" or "smem_to_gmem"
    shape: tuple[int, ...]
    dtype: str
    offset_bytes: int


def _offset_bytes(key_array, transforms) -> tuple[tuple[int, ...], str, int]:
    mem = gpu_callbacks._get_shared_memory()
    key = HostAllocationKey.from_array(key_array)
    transforms = gpu_callbacks.jax.tree.map(int, gpu_callbacks._remove_noop_transforms(transforms))
    shape = tuple(int(d) for d in mem.buffer_shape_and_dtype(key).shape)
    dtype = np.dtype(mem.buffer_shape_and_dtype(key).dtype)
    rng = mem.access(key, transforms).range
    starts = [r if isinstance(r, int) else (r.start or 0) for r in rng]
    strides = [math.prod(shape[i + 1:]) for i in range(len(shape))]
    return shape, str(dtype), sum(s * st for s, st in zip(starts, strides)) * dtype.itemsize


@contextlib.contextmanager
def record_smem_copies():
    """Yield a list filled with a :class:`SmemCopy` per TMA copy while the block runs."""
    seen: list[SmemCopy] = []
    g2s, s2g = gpu_callbacks.copy_gmem_to_smem, gpu_callbacks.copy_smem_to_gmem

    def copy_gmem_to_smem(**kw):
        shape, dtype, off = _offset_bytes(kw["dst_allocation_key_as_array"],
                                          kw["dst_transforms"])
        seen.append(SmemCopy("gmem_to_smem", shape, dtype, off))
        return g2s(**kw)

    def copy_smem_to_gmem(**kw):
        shape, dtype, off = _offset_bytes(kw["src_allocation_key_as_array"],
                                          kw["src_transforms"])
        seen.append(SmemCopy("smem_to_gmem", shape, dtype, off))
        return s2g(**kw)

    gpu_callbacks.copy_gmem_to_smem = copy_gmem_to_smem
    gpu_callbacks.copy_smem_to_gmem = copy_smem_to_gmem
    try:
        yield seen
    finally:
        gpu_callbacks.copy_gmem_to_smem, gpu_callbacks.copy_smem_to_gmem = g2s, s2g
