"""The decoder's projections: ``h @ w`` for bf16 / FP8 weights on XLA or the Pallas GEMMs.

:func:`project` picks the path for one projection (the FP8 kernels' norm-quant + GEMM, XLA's
W8A16, a plain dot) and optionally adds a residual in front (inside the norm-quant kernel
where it runs, split-K partials included); :func:`fp8_kernel_linear` is the FP8 GEMM under
its own ``jit``; :func:`reduced` sums a split-K GEMM's partials where nothing consumes them
unsummed. ``jaxinfer.models.transformer`` calls these under its own names (``_proj``,
``_fp8_kernel_linear``, ``_reduced``), which quantization_gptq and tests patch.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxinfer.layers.norm import rms_norm
from jaxinfer.quantization import fp8_weight_linear
from pallas_kernels.matmul.splitk import SplitKPartials


def project(h: jax.Array, w: dict[str, jax.Array], name: str, kernels: bool = False,
          interpret: bool = False, norm: jax.Array | None = None, eps: float = 0.0,
          gate_up: bool = False, unreduced: bool = False,
          residual: jax.Array | SplitKPartials | None = None):
    """``h @ w[name]``, after ``rms_norm(h, norm, eps)`` when ``norm`` is given. FP8 weights:
    with ``kernels`` and a per-channel scale the weight is held as ``[N, K]`` and runs on the
    Pallas GEMMs the measured policy picks for the row count
    (pallas_kernels.matmul.fp8_plan.fp8_engine_linear: W8A8 on the Triton or Mosaic GPU
    kernels, W8A16 on XLA where none takes the shape); where that is the Triton decode GEMM
    the norm and the per-token quantization run as one kernel first
    (pallas_kernels.matmul.row_quant.norm_quant_fp8: one CUDA-graph node instead of XLA's
    two or three). Otherwise an FP8 weight is widened to h's dtype in an XLA GEMM (W8A16)
    and scaled per channel after it, or per group of input rows (block-FP8 checkpoints;
    jaxinfer.quantization.fp8_weight_linear). ``gate_up``: the FP8 kernels' ``[2F, K]``
    gate/up weight, returning ``silu(gate) * up`` (only with ``kernels``). ``unreduced``:
    a split-K Triton GEMM's ``SplitKPartials`` for the consumer to sum (the QKV projection:
    the attention backend's attend_qkv), else the array. ``residual`` ([T, K] in h's dtype,
    or a split-K GEMM's unreduced output): project ``h + residual`` and return ``(out, h +
    residual)``; inside norm_quant_fp8 (partials summed there too) where that kernel runs,
    else an XLA add first."""
    scale = w.get(name + "_scale")
    if residual is not None:
        if kernels and scale is not None and scale.ndim == 1:
            from pallas_kernels.matmul.fp8_plan import fp8_takes_quantized_x
            from pallas_kernels.matmul.row_quant import norm_quant_fp8

            if fp8_takes_quantized_x(h.shape[0], h.shape[1], w[name].shape[0], gate_up):
                xq, xs, h = norm_quant_fp8(h, norm, eps, residual=residual,
                                           interpret=interpret)
                return fp8_kernel_linear(xq, w[name], scale, gate_up=gate_up,
                                          interpret=interpret, x_scale=xs, out_dtype=h.dtype,
                                          env=kernel_env_key(), unreduced=unreduced), h
        h = h + reduced(residual)
        return project(h, w, name, kernels, interpret, norm, eps, gate_up, unreduced), h
    if kernels and scale is not None and scale.ndim == 1:
        from pallas_kernels.matmul.fp8_plan import fp8_takes_quantized_x
        from pallas_kernels.matmul.row_quant import norm_quant_fp8

        env = kernel_env_key()
        if fp8_takes_quantized_x(h.shape[0], h.shape[1], w[name].shape[0], gate_up):
            xq, xs = norm_quant_fp8(h, norm, eps, interpret=interpret)
            return fp8_kernel_linear(xq, w[name], scale, gate_up=gate_up, interpret=interpret,
                                      x_scale=xs, out_dtype=h.dtype, env=env,
                                      unreduced=unreduced)
        h = h if norm is None else rms_norm(h, norm, eps)
        return fp8_kernel_linear(h, w[name], scale, gate_up=gate_up, interpret=interpret,
                                  env=env, unreduced=unreduced)
    if gate_up:
        raise ValueError(f"project: gate_up needs the FP8 kernels and a per-channel scale ({name})")
    h = h if norm is None else rms_norm(h, norm, eps)
    if scale is None:
        return h @ w[name]
    return fp8_weight_linear(h, w[name], scale)


def reduced(x: jax.Array | SplitKPartials) -> jax.Array:
    """A projection's output: a split-K GEMM's partials summed by its XLA epilogue."""
    return x.reduce() if isinstance(x, SplitKPartials) else x


def kernel_env_key() -> tuple[tuple[str, str], ...]:
    """The FP8 GEMM plan's environment switches in effect (``fp8_plan.env_values``), as a
    hashable static argument of :func:`fp8_kernel_linear`: its trace cache outlives an
    engine, and the switches are read while tracing, so without it an engine built after a
    switch changed in the same process would reuse the traces made under the old value.
    Raises LinearError for a value a switch does not take (the engine checks at start)."""
    from pallas_kernels.matmul.fp8_plan import env_values

    return tuple(sorted(env_values().items()))


@functools.partial(jax.jit, static_argnames=("gate_up", "interpret", "out_dtype", "env",
                                             "unreduced"))
def fp8_kernel_linear(h: jax.Array, w_nk: jax.Array, scale: jax.Array, gate_up: bool = False,
                       interpret: bool = False, x_scale: jax.Array | None = None,
                       out_dtype: jnp.dtype | None = None,
                       env: tuple[tuple[str, str], ...] = (),
                       unreduced: bool = False) -> jax.Array | SplitKPartials:
    """pallas_kernels.matmul.fp8_plan.fp8_engine_linear under its own ``jit``: the unrolled layers'
    calls of one shape share one traced and lowered function (XLA inlines it), so a kernel's
    Python lowering runs once per shape, not once per layer. Lowering a Mosaic GPU GEMM took
    0.4-1 s a call: an 8B prefill program with 128 of them compiled in ~130 s, not ~20 s.
    ``env``: :func:`kernel_env_key` where the call is traced (part of the trace cache key)."""
    from pallas_kernels.matmul.fp8_plan import fp8_engine_linear

    return fp8_engine_linear(h, w_nk, scale, gate_up=gate_up, interpret=interpret,
                             x_scale=x_scale, out_dtype=out_dtype or h.dtype,
                             unreduced=unreduced)


def to_kernel_layout(weights: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """FP8 projections with per-channel scales ``[K, N]`` -> ``[N, K]`` (the layout the
    Pallas GEMMs stream: rows of K contiguous bytes; pallas_kernels.matmul.api); stacked
    ``[L, K, N]`` (scales ``[L, N]``, the scanned layers) -> ``[L, N, K]``. Block-scaled
    weights (scales with as many axes as the weight) stay as they are (XLA W8A16)."""
    out = dict(weights)
    for name, value in weights.items():
        scale = weights.get(name + "_scale")
        if (value.dtype == jnp.float8_e4m3fn and scale is not None
                and scale.ndim == value.ndim - 1):
            out[name] = jnp.swapaxes(value, -1, -2)
    return out
