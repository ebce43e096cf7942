"""RMSNorm and per-token FP8 quantization of a decode GEMM's input rows in one Pallas kernel.

Before each FP8 W8A8 projection the engine quantizes its activations per token
(``reference.quantize_rows_fp8``: absmax -> scale -> e4m3). XLA emits that as two kernels (the
absmax reduction, then the scaling convert) and the RMSNorm in front of the QKV and gate/up
projections as one more reduction: three kernels per site, each a node of the decode step's
CUDA graph. On an H200 the batch-1 8B FP8 step is one graph of ~810 nodes whose launch costs
the host ~2 us a node (benchmarks/decode_launch.py, session 11), more than the device time of
these tiny kernels; this kernel does norm + absmax + quantize (or absmax + quantize) for a row
in one program: one node per site (six fewer per layer). Same math as
``quantize_rows_fp8(rms_norm(x.astype(float32), weight, eps))`` (jaxinfer/layers/norm.py): the
normed row stays in float32 up to its quantization (one rounding, to e4m3), as the unfused path
compiles (XLA keeps the bf16 ``rms_norm`` output in float32 inside the fusion:
``xla_allow_excess_precision``, on by default).
vLLM fuses the same pair (``rms_norm_dynamic_per_token_quant``, its fused RMSNorm + FP8 quant
kernel); TensorRT-LLM's RMSNorm plugin has a quantized-output mode. The same kernel also takes
the residual add in front (``residual=``: vLLM's ``fused_add_rms_norm``) and SwiGLU in front of
the down projection's quantization (``swiglu=True``: vLLM's ``silu_and_mul`` + quant).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.matmul.reference import FP8, FP8_MAX, MIN_ABSMAX
from pallas_kernels.matmul.splitk import SplitKPartials, splitk_epilogue_row

# Widest row one program takes, and the most chunks it walks a row in (the row is read in
# power-of-two chunks of at most 4096 columns, each pass unrolled).
ROW_QUANT_MAX_K = 16384
ROW_QUANT_MAX_CHUNKS = 16
# Warps a program (a row) runs with from ROW_QUANT_WIDE_K columns (4 below: SmolLM2's and
# Gemma 3's narrow rows, not timed), and whether it reads the row once and holds it in
# registers (else once a pass: mean square, absmax, quantize). H200, 8B FP8 decode step
# (profile_decode, session 23 call 3; NOTES_matmul "Session 23"): 16 warps and one pass vs
# 4 warps and passes, µs a step: 64 rows, the QKV / gate-up norm + quant 140.9 vs 172.6,
# the down input's quant ([64, 14336]) 93.3 vs 181.1, the o input's 58.3 vs 60.8 (device
# busy 4.296 vs 4.450 ms); 1 row 136.9 / 93.4 / 47.8 vs 146.4 / 166.2 / 50.9 (2.896 vs
# 2.978 ms).
ROW_QUANT_WARPS = 16
ROW_QUANT_WIDE_K = 4096
ROW_QUANT_ONE_PASS = True


def _chunk(K: int) -> int:
    """The largest power of two <= 4096 dividing K (0 if K is not a multiple of 64)."""
    c = 4096
    while c >= 64 and K % c:
        c //= 2
    return c if c >= 64 else 0


def row_quant_supported(K: int) -> bool:
    """Whether :func:`norm_quant_fp8` takes rows of K columns: K <= 16384, a multiple of
    64 that at most 16 power-of-two chunks cover (4096, 8192, 14336 = 7 x 2048, 576 = 9 x 64)."""
    c = _chunk(K)
    return 0 < K <= ROW_QUANT_MAX_K and c > 0 and K // c <= ROW_QUANT_MAX_CHUNKS


def _kernel(*refs, eps: float, norm: bool, residual: bool, splits: int, has_xs: bool,
            has_ws: bool, swiglu: bool, one_pass: bool, K: int, C: int):
    refs = list(refs)
    x_ref = refs.pop(0)
    d_ref = refs.pop(0) if residual else None
    xs_ref = refs.pop(0) if has_xs else None  # a split-K residual's epilogue scales
    ws_ref = refs.pop(0) if has_ws else None
    w_ref = refs.pop(0) if norm else None
    q_ref, s_ref = refs[:2]
    h_ref = refs[2] if residual else None
    r = pl.program_id(0)
    chunks = range(K // C)

    def load(c):  # [1, C] float32: x, or x + delta rounded to x's dtype (the residual stream)
        x = x_ref[pl.ds(r, 1), pl.ds(c * C, C)]
        if swiglu:  # silu(gate) * up in float32, rounded to x's dtype (silu_mul_ref)
            g = x.astype(jnp.float32)
            u = x_ref[pl.ds(r, 1), pl.ds(K + c * C, C)].astype(jnp.float32)
            x = (g * jax.nn.sigmoid(g) * u).astype(x.dtype)
        if residual:
            x = (x.astype(jnp.float32) + delta(c, x.dtype)).astype(x.dtype)
        return x.astype(jnp.float32)

    def delta(c, dtype):  # [1, C] float32: the residual's chunk as x's dtype holds it
        cols = pl.ds(c * C, C)
        if not splits:
            return d_ref[pl.ds(r, 1), cols].astype(jnp.float32)
        return splitk_epilogue_row(d_ref, xs_ref, ws_ref, r, cols, C, splits, dtype)

    # one_pass: the row read once and held in registers (float32 chunks) to the end; else
    # each pass reads it again (the re-reads hit the L1 / L2)
    get = [load(c) for c in chunks].__getitem__ if one_pass else load
    if residual:  # the sum, written once
        for c in chunks:
            h_ref[pl.ds(r, 1), pl.ds(c * C, C)] = get(c).astype(h_ref.dtype)
    if norm:
        ss = sum(jnp.sum(jnp.square(get(c)), axis=-1, keepdims=True) for c in chunks)
        inv = jax.lax.rsqrt(ss / K + eps)

        def row(c):  # the normed chunk, float32
            return get(c) * inv * w_ref[pl.ds(0, 1), pl.ds(c * C, C)].astype(jnp.float32)
        if one_pass:  # normed once too
            row = [row(c) for c in chunks].__getitem__
    else:
        row = get
    amax = functools.reduce(jnp.maximum, (jnp.max(jnp.abs(row(c)), axis=-1, keepdims=True)
                                          for c in chunks))
    scale = jnp.maximum(amax, MIN_ABSMAX) / FP8_MAX
    for c in chunks:
        q_ref[pl.ds(r, 1), pl.ds(c * C, C)] = jnp.clip(row(c) / scale, -FP8_MAX,
                                                       FP8_MAX).astype(FP8)
    s_ref[pl.ds(r, 1), pl.ds(0, 1)] = scale


@functools.partial(jax.jit, static_argnames=("eps", "swiglu", "num_warps", "one_pass",
                                             "interpret"))
def norm_quant_fp8(x: jax.Array, weight: jax.Array | None = None, eps: float = 1e-6, *,
                   residual: jax.Array | SplitKPartials | None = None, swiglu: bool = False,
                   num_warps: int | None = None, one_pass: bool | None = None,
                   interpret: bool = False) -> tuple[jax.Array, ...]:
    """Per-token FP8 quantization of ``x`` rows, after an RMSNorm when ``weight`` is given;
    with ``residual``, of the rows of ``h = x + residual`` (the residual add of a decoder
    layer fused in front: vLLM's ``fused_add_rms_norm``, here with the quantization too);
    with ``swiglu``, of ``silu(gate) * up`` from a gate/up GEMM's ``[M, 2F]`` output (the
    down projection's input: vLLM's ``silu_and_mul`` + per-token quant, one kernel).

    Args:
      x: [M, K] activations (bf16 or f32); K with :func:`row_quant_supported`. One program
        per row walks it in power-of-two chunks (``one_pass``, or three passes with the
        norm: mean square, absmax, quantize).
      weight: [K] RMSNorm weight (Gemma's ``1 + w`` folded in), or None for no norm.
      eps: added to the mean square.
      residual: [M, K] in x's dtype, or None: ``h = (x + residual)`` rounded to x's dtype
        (as XLA's add of the two) is normed / quantized and returned. Or a split-K GEMM's
        unreduced output (``splitk.SplitKPartials`` with ``out_dtype`` x's dtype: the o /
        down projection's [S, M, K] float32 partials and scales), summed here in its
        epilogue's order first: the GEMM's output, the residual add, the norm and the
        quantization in one kernel, where XLA ran the epilogue + add as a fusion of its own.
      swiglu: x is ``[M, 2K]``, gate columns then up columns; the rows quantized are
        ``silu(gate) * up`` computed in float32 and rounded to x's dtype
        (``reference.silu_mul_ref``). Not with ``weight`` or ``residual``.
      num_warps: warps a row's program runs with (default :data:`ROW_QUANT_WARPS` from
        :data:`ROW_QUANT_WIDE_K` columns, 4 below).
      one_pass: read the row once and keep it in registers (default
        :data:`ROW_QUANT_ONE_PASS`); the same results either way.
      interpret: run in Pallas interpret mode (CPU tests).
    Returns:
      ``(q [M, K] float8_e4m3fn, scale [M] float32)`` with ``h ≈ q * scale[:, None]``, h the
      normed row in float32 (or x): ``quantize_rows_fp8(rms_norm(x.astype(float32), weight,
      eps))``; with ``residual``, ``(q, scale, h [M, K] x.dtype)``.
    Raises:
      ValueError: x not 2-D, K unsupported, weight not [K], residual not x's shape and
        dtype (split-K partials: also ``SplitKPartials.check``), swiglu with an odd column
        count or with weight / residual.
    """
    if x.ndim != 2:
        raise ValueError(f"norm_quant_fp8: x must be [M, K], got shape {x.shape}")
    M, K = x.shape
    if swiglu:
        if K % 2 or weight is not None or residual is not None:
            raise ValueError(f"norm_quant_fp8: swiglu takes [M, 2F] gate/up rows without a "
                             f"norm weight or residual, got shape {x.shape}, weight "
                             f"{weight is not None}, residual {residual is not None}")
        K //= 2
    if not row_quant_supported(K):
        raise ValueError(f"norm_quant_fp8: K={K} must be a multiple of 64 up to "
                         f"{ROW_QUANT_MAX_K} in at most {ROW_QUANT_MAX_CHUNKS} power-of-two "
                         "chunks (row_quant_supported)")
    norm = weight is not None
    if norm and weight.shape != (K,):
        raise ValueError(f"norm_quant_fp8: weight must be [{K}], got {weight.shape}")
    add = residual is not None
    split = isinstance(residual, SplitKPartials)
    if split:
        residual.check("norm_quant_fp8")
    r_dtype = jnp.dtype(residual.out_dtype if split else residual.dtype) if add else None
    if add and (tuple(residual.shape) != x.shape or r_dtype != x.dtype):
        raise ValueError(f"norm_quant_fp8: residual must be {x.shape} {x.dtype.name}, got "
                         f"{tuple(residual.shape)} {r_dtype.name}")
    epilogue = ()
    if split:
        epilogue = tuple(a for a in (residual.x_scale, residual.w_scale) if a is not None)
    args = ((x,) + (((residual.partials if split else residual),) if add else ()) + epilogue
            + ((weight.reshape(1, K),) if norm else ()))
    out_shape = (jax.ShapeDtypeStruct((M, K), FP8), jax.ShapeDtypeStruct((M, 1), jnp.float32))
    if add:
        out_shape += (jax.ShapeDtypeStruct((M, K), x.dtype),)
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    out = pl.pallas_call(
        functools.partial(_kernel, eps=eps, norm=norm, residual=add,
                          splits=residual.partials.shape[0] if split else 0,
                          has_xs=split and residual.x_scale is not None,
                          has_ws=split and residual.w_scale is not None, swiglu=swiglu,
                          one_pass=ROW_QUANT_ONE_PASS if one_pass is None else one_pass,
                          K=K, C=_chunk(K)),
        out_shape=out_shape,
        grid=(M,), in_specs=[any_spec] * len(args), out_specs=(any_spec,) * len(out_shape),
        compiler_params=plt.CompilerParams(
            num_warps=num_warps or (ROW_QUANT_WARPS if K >= ROW_QUANT_WIDE_K else 4),
            num_stages=1),
        interpret=interpret, name="norm_quant_fp8")(*args)
    return (out[0], out[1][:, 0]) + tuple(out[2:])
