"""A split-K GEMM's float32 partials before their epilogue, and that epilogue.

The skinny GEMM (:mod:`.triton_gemm`) splits K over programs at decode shapes and writes
``[S, M, N]`` float32 partials; the epilogue (sum over S in a fixed order, per-token and
per-channel scales, cast) runs as one XLA fusion (:func:`xla_epilogue`), or inside the next
kernel when that kernel takes a :class:`SplitKPartials` (``row_quant.norm_quant_fp8``'s
residual, ``paged_attention.rope_kv_write``) through :func:`splitk_epilogue_row` — one
launch less a projection.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl


def xla_epilogue(partials: jax.Array, w_scale: jax.Array | None, x_scale: jax.Array | None,
                 gate_up: bool, out_dtype: jnp.dtype) -> jax.Array:
    """[M, N] (``[M, N/2]`` for gate_up) in ``out_dtype`` from ``partials`` [S, M, N] float32:
    ``sum_s partials[s] * x_scale[:, None] * w_scale[None, :]`` (scales [M] / [N] f32 or None),
    then ``silu(gate) * up`` over the two column halves when ``gate_up``."""
    acc = jnp.sum(partials, axis=0)  # [M, Nw] f32
    if x_scale is not None:
        acc = acc * x_scale[:, None]
    if w_scale is not None:
        acc = acc * w_scale[None, :]
    if gate_up:
        f = acc.shape[1] // 2
        acc = jax.nn.silu(acc[:, :f]) * acc[:, f:]
    return acc.astype(out_dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SplitKPartials:
    """A split-K GEMM's result before its epilogue, for a consumer that sums it itself (one
    launch less: rope_kv_write takes it): ``partials`` [S, M, N] float32, ``x_scale`` [M] /
    ``w_scale`` [N] float32 or None, ``out_dtype`` the dtype the epilogue casts to.
    :meth:`reduce` is the epilogue XLA runs otherwise: ``out = (sum_s partials[s] * x_scale
    * w_scale).astype(out_dtype)``, in that order."""

    partials: jax.Array
    x_scale: jax.Array | None
    w_scale: jax.Array | None
    out_dtype: jnp.dtype = dataclasses.field(metadata=dict(static=True),
                                             default=jnp.bfloat16)

    @property
    def shape(self) -> tuple[int, int]:
        """[M, N] of the reduced output."""
        return self.partials.shape[1:]

    def check(self, where: str) -> None:
        """Raises ValueError unless ``partials`` is [S >= 1, M, N] float32 and the scales are
        [M] / [N] float32 or None (a kernel indexes them per row / column: a broadcastable
        per-tensor scale would be read out of bounds)."""
        p = self.partials
        if p.ndim != 3 or p.shape[0] < 1 or p.dtype != jnp.float32:
            raise ValueError(f"{where}: split-K partials must be [S >= 1, M, N] float32, got "
                             f"{p.shape} {p.dtype}")
        for name, a, n in (("x_scale", self.x_scale, p.shape[1]),
                           ("w_scale", self.w_scale, p.shape[2])):
            if a is not None and (a.shape != (n,) or a.dtype != jnp.float32):
                raise ValueError(f"{where}: split-K {name} must be [{n}] float32 or None, "
                                 f"got {a.shape} {a.dtype}")

    def reduce(self) -> jax.Array:
        """[M, N] in ``out_dtype``: the GEMM's output (the XLA epilogue)."""
        return xla_epilogue(self.partials, self.w_scale, self.x_scale, False, self.out_dtype)


def splitk_epilogue_row(p_ref, xs_ref, ws_ref, row, cols, n: int, splits: int,
                        dtype) -> jax.Array:
    """Inside a Pallas kernel that takes a :class:`SplitKPartials`: ``[1, n]`` float32 of the
    GEMM's output at ``row`` and columns ``cols`` (a ``pl.ds`` of n) as :meth:`reduce`
    computes it: the partials summed in order, times ``x_scale[row]`` and ``w_scale[cols]``
    (``xs_ref`` / ``ws_ref`` None where absent), rounded to ``dtype``."""
    x = p_ref[0, pl.ds(row, 1), cols]
    for s in range(1, splits):
        x = x + p_ref[s, pl.ds(row, 1), cols]
    if xs_ref is not None:
        x = x * xs_ref[row]
    if ws_ref is not None:
        x = x * ws_ref[cols].reshape(1, n)
    return x.astype(dtype).astype(jnp.float32)
