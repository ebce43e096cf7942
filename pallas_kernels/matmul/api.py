"""The engine's entry points for linear layers: ``prepare_weight``, ``linear``,
``linear_supported`` (the FP8 plan the engine runs them with: :mod:`.fp8_plan`).

Weights reach the kernels in a *prepared* form, made once at load time by
:func:`prepare_weight`: the engine's ``[K, N]`` weight transposed to ``[N, K]`` (K contiguous:
the B layout FP8 wgmma needs and the row layout a decode GEMV streams), wrapped with its FP8
scale in a :class:`PreparedWeight` pytree (so it passes through ``jit`` and ``lax.scan``; a
stacked ``[L, K, N]`` weight becomes ``[L, N, K]`` and is read in place at ``layer``).

Backends (``backend=``):

* ``"xla"``    — ``jnp`` dot (cuBLAS / XLA's Triton GEMM); always available; the fallback.
* ``"triton"`` — :mod:`.triton_gemm`, Pallas-Triton skinny GEMM, any M (tuned for M <= 256),
  bf16 / W8A16 / W8A8, fused gate+up SwiGLU, ragged M and N by masking.
* ``"mgpu"``   — :mod:`.mgpu_gemm`, Pallas Mosaic GPU wgmma GEMM for prefill (M padded to
  128), bf16 x bf16 or FP8 x FP8 (W8A8), N % 256 == 0, K % 128 (FP8) / 64 (bf16) == 0.
* ``"mgpu_decode"`` — :func:`.mgpu_gemm.mgpu_decode_linear`, swap-AB wgmma for M <= 256
  (weights on the MMA's 64-row side, tokens padded to 16k on the other; 129-240 rows not
  taken: see :func:`.mgpu_gemm.mgpu_decode_supported`), split-K for small N; same dtype
  rules as ``"mgpu"``, N % 64 == 0.
* ``"auto"``   — picks by shape from what was measured on an H200
  (benchmarks/kernels/NOTES_matmul.md): today the Triton kernel for W8A8 decode (M <= 64),
  XLA everywhere else (XLA's bf16 and W8A16 decode GEMMs were faster than ours; the Mosaic
  GPU kernels pass CPU interpret and CUDA-lowering tests but have not run on a GPU yet).

Per-group FP8 weight scales (``scale [N, K / g]``, block-FP8 checkpoints) run only on the XLA
path (:func:`.reference.grouped_linear_ref`), W8A16 only; the kernels take one scale per
output channel (a kernel would load the ``[N, G]`` scale tile beside each K step and scale
each K-group's partial sum before accumulating).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels.matmul import mgpu_gemm, triton_gemm
from pallas_kernels.matmul.reference import (
    FP8,
    grouped_linear_ref,
    quantize_row_groups_fp8,
    quantize_rows_fp8,
    silu_mul_ref,
)

F32 = jnp.float32
BACKENDS = ("auto", "xla", "triton", "mgpu", "mgpu_decode")
# "auto" sends W8A8 (act_quant) decode with M <= AUTO_TRITON_MAX_M to the Triton kernel: the
# only case where a kernel here was measured faster than XLA on an H200 (1.3-11x over XLA's
# FP8 dot for M = 8..64; NOTES_matmul.md). Everything else runs XLA.
AUTO_TRITON_MAX_M = 64


class LinearError(ValueError):
    """A linear layer was called with mismatched shapes, dtypes or an unknown backend."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PreparedWeight:
    """A projection weight in kernel layout.

    Attributes:
      w: [N, K] (or stacked [L, N, K]) bf16 or float8_e4m3fn. For ``gate_up`` N = 2F with
        the gate rows first.
      scale: [N] (or [L, N]) float32 per-output-channel scale for FP8, or [N, G] (or
        [L, N, G]) per group of ``K / G`` input columns (XLA path only), else None.
      gate_up: static; :func:`linear` then returns ``silu(x @ Wg) * (x @ Wu)`` ([M, F]).
    """

    w: jax.Array
    scale: jax.Array | None
    gate_up: bool = dataclasses.field(default=False, metadata={"static": True})

    @property
    def stacked(self) -> bool:
        return self.w.ndim == 3

    @property
    def grouped(self) -> bool:
        """Per-group (not per-channel) scales."""
        return self.scale is not None and self.scale.ndim == self.w.ndim


def prepare_weight(w: jax.Array, w_scale: jax.Array | None = None, *,
                   gate_up: bool = False) -> PreparedWeight:
    """Re-lay an engine weight ``[K, N]`` (or ``[L, K, N]``) as ``[N, K]`` once, at load time.

    Args:
      w: bf16 weight, or float8_e4m3fn from ``jaxinfer.quantization.quantize_fp8_weight``.
      w_scale: [N] (or [L, N]) f32, or per group [G, N] (or [L, G, N]) with G dividing K;
        required for FP8 weights.
      gate_up: ``w`` is ``concat([w_gate, w_up], axis=-1)`` ([K, 2F]); see
        :func:`prepare_gate_up`.
    Returns:
      :class:`PreparedWeight` with ``w`` [N, K] (or [L, N, K]) in w's dtype and ``scale``
      float32 [N] / [N, G] (or stacked) or None. Layout: K-major, the B operand of Hopper's
      FP8 wgmma (module docstring).
    Raises:
      LinearError: wrong rank, FP8 without a scale, a scale of neither shape above, or odd N
        with ``gate_up``.
    """
    if w.ndim not in (2, 3):
        raise LinearError(f"prepare_weight: weight must be [K, N] or [L, K, N], got {w.shape}")
    if w.dtype == FP8 and w_scale is None:
        raise LinearError("prepare_weight: an FP8 weight needs its per-channel scale")
    lead, (K, N) = w.shape[:-2], w.shape[-2:]
    if w_scale is not None and w_scale.shape != lead + (N,) and not (
            w_scale.ndim == w.ndim and w_scale.shape[:-2] == lead and w_scale.shape[-1] == N
            and w_scale.shape[-2] > 0 and K % w_scale.shape[-2] == 0):
        raise LinearError(f"prepare_weight: scale shape {w_scale.shape} does not match "
                          f"weight {w.shape} (per channel {lead + (N,)} or per group "
                          f"{lead + ('G', N)} with G dividing {K})")
    if gate_up and w.shape[-1] % 2:
        raise LinearError(f"prepare_weight: gate_up weight needs an even N, got {w.shape}")
    w_nk = jnp.swapaxes(w, -1, -2)
    scale = None if w_scale is None else w_scale.astype(jnp.float32)
    if scale is not None and scale.ndim == w.ndim:  # [.., G, N] -> [.., N, G]
        scale = jnp.swapaxes(scale, -1, -2)
    return PreparedWeight(w=w_nk, scale=scale, gate_up=gate_up)


def prepare_gate_up(w_gate: jax.Array, w_up: jax.Array, s_gate: jax.Array | None = None,
                    s_up: jax.Array | None = None) -> PreparedWeight:
    """Fuse ``w_gate, w_up [K, F]`` (or [L, K, F]) into one gate+up :class:`PreparedWeight`
    (``w`` [2F, K], gate rows first); ``s_gate, s_up`` [F] (or [L, F]) f32 FP8 scales,
    both or neither. Raises LinearError as :func:`prepare_weight`, and when only one scale
    is given."""
    if (s_gate is None) != (s_up is None):
        raise LinearError("prepare_gate_up: give both scales (s_gate and s_up) or neither, got "
                          f"only {'s_gate' if s_up is None else 's_up'}")
    w = jnp.concatenate([w_gate, w_up], axis=-1)
    s = None if s_gate is None else jnp.concatenate([s_gate, s_up], axis=-1)
    return prepare_weight(w, s, gate_up=True)


def linear_supported(M: int, K: int, N: int, dtype: jnp.dtype, *,
                     act_quant: bool = False, gate_up: bool = False) -> bool:
    """Whether ``backend="auto"`` runs a Pallas kernel (not XLA) for this shape and weight dtype.

    ``dtype`` is the weight dtype (bf16 or float8_e4m3fn); N is the weight's row count.
    True only where a kernel measured faster than XLA (see :data:`AUTO_TRITON_MAX_M`); no
    exception for any int shape (those no kernel takes give False).
    """
    return _pick_backend(M, K, N, jnp.dtype(dtype), act_quant, gate_up) != "xla"


def _pick_backend(M: int, K: int, N: int, dtype: jnp.dtype, act_quant: bool,
                  gate_up: bool = False) -> str:
    if dtype != jnp.dtype(FP8) or not act_quant or K % 16 or M > AUTO_TRITON_MAX_M:
        return "xla"
    if M < 8 and (gate_up or K * N <= 4096 * 4096):
        return "xla"  # M = 1 measured: XLA ahead on the 8B o_proj and the fused gate+up
    return "triton"


def _xla_linear(x: jax.Array, w_nk: jax.Array, w_scale: jax.Array | None,
                x_scale: jax.Array | None, out_dtype: jnp.dtype) -> jax.Array:
    if w_scale is not None and w_scale.ndim == 2:  # per-group scales [N, G] (W8A16)
        return grouped_linear_ref(x, w_nk, w_scale, out_dtype)
    dn = (((1,), (1,)), ((), ()))
    if x_scale is not None and x_scale.ndim == 2:  # per (token, group of K / G columns)
        (M, K), G = x.shape, x_scale.shape[1]
        part = jax.lax.dot_general(x.reshape(M, G, K // G), w_nk.reshape(-1, G, K // G),
                                   (((2,), (2,)), ((1,), (1,))),
                                   preferred_element_type=jnp.float32)  # [G, M, N]
        acc = jnp.einsum("gmn,mg->mn", part, x_scale)
        x_scale = None
    elif x.dtype == FP8 and w_nk.dtype == FP8:
        acc = jax.lax.dot_general(x, w_nk, dn, preferred_element_type=jnp.float32)
    else:
        w = w_nk.astype(x.dtype) if w_nk.dtype != x.dtype else w_nk
        acc = jax.lax.dot_general(x, w, dn, preferred_element_type=jnp.float32)
    if x_scale is not None:
        acc = acc * x_scale[:, None]
    if w_scale is not None:
        acc = acc * w_scale[None, :]
    return acc.astype(out_dtype)


def linear(x: jax.Array, w: PreparedWeight | jax.Array, w_scale: jax.Array | None = None, *,
           layer: jax.Array | int | None = None, act_quant: bool = False,
           act_group: int = 0, backend: str = "auto", interpret: bool = False,
           triton_config: triton_gemm.TritonConfig | None = None,
           mgpu_config: mgpu_gemm.MgpuConfig | None = None,
           x_scale: jax.Array | None = None, out_dtype: jnp.dtype | None = None,
           unreduced: bool = False) -> jax.Array | triton_gemm.SplitKPartials:
    """A linear layer ``x @ W`` (with FP8 scaling / fused SwiGLU), dispatched to a kernel.

    FP8 scaling: per-token activation x per-output-channel weight scales on the float32
    accumulator (vLLM / TensorRT-LLM; DeepSeek-V3's 1 x 128 tiles with ``act_group``).

    Args:
      x: [M, K] bf16 (or f32) activations; float8_e4m3fn with ``x_scale``.
      w: a :class:`PreparedWeight` (kernel layout; stacked ones need ``layer``), or a plain
        engine-layout ``[K, N]`` array (then only ``backend="xla"``/``"auto"``, which runs XLA).
      w_scale: [N] (or per group [G, N]) f32 scale for a plain FP8 ``w`` (a PreparedWeight
        carries its own).
      layer: int32 scalar picking the layer of a stacked PreparedWeight.
      act_quant: quantize ``x`` per token to FP8 first (W8A8); needs an FP8 weight.
      act_group: with act_quant, one scale per token and group of ``act_group`` columns of x
        instead (DeepSeek-V3's 1 x 128 activation tiles): inside the GEMM on ``"triton"``
        (``triton_config.act_group`` must equal it), before an XLA dot on ``"xla"``.
      backend: one of ``BACKENDS``.
      interpret: run Pallas kernels in interpret mode (CPU tests).
      x_scale: [M] f32 per-token scales of an ``x`` already quantized to float8_e4m3fn
        (``row_quant.norm_quant_fp8``); needs act_quant=True, no act_group and out_dtype.
      out_dtype: the result dtype (default x.dtype).
      unreduced: on ``"triton"``, a split-K result as ``triton_gemm.SplitKPartials`` (the
        caller sums it); every other case returns the array as usual.
    Returns:
      [M, N] in ``out_dtype`` ([M, F] for a gate_up weight: ``silu(gate) * up``).
    Raises:
      LinearError: unknown backend, x not 2-D, mismatched K, act_quant with a bf16 weight, a
        stacked weight without ``layer``, a plain ``w`` on a kernel backend, per-group scales
        with act_quant or a kernel backend, an ``x_scale`` outside the rules above, x and w
        of two dtypes on "mgpu" / "mgpu_decode", a backend that cannot take the shape, or
        act_group without act_quant, on a backend other than triton / xla, or not matching
        the triton config; :func:`prepare_weight`'s for a plain ``w`` with ``w_scale``.
      ValueError: :func:`.triton_gemm.triton_linear`'s, on "triton" (e.g. a ``triton_config``
        whose ``split_k * bk`` does not divide K, or an FP8 weight without a scale).
    """
    if backend not in BACKENDS:
        raise LinearError(f"linear: unknown backend {backend!r}; choose from {BACKENDS}")
    if x.ndim != 2:
        raise LinearError(f"linear: x must be [M, K], got shape {x.shape}")
    if not isinstance(w, PreparedWeight):
        if backend not in ("auto", "xla"):
            raise LinearError(f"linear: backend {backend!r} needs a PreparedWeight "
                              "(call prepare_weight once at load time)")
        w = prepare_weight(w, w_scale)  # refuses an FP8 weight without its scale
        backend = "xla"
    if w.stacked and layer is None:
        raise LinearError("linear: a stacked [L, N, K] weight needs `layer`")
    M, K = x.shape
    Nw, Kw = w.w.shape[-2:]
    if K != Kw:
        raise LinearError(f"linear: x has K={K} but the weight has K={Kw}")
    if act_quant and w.w.dtype != FP8:
        raise LinearError("linear: act_quant=True (W8A8) needs an FP8 weight")
    if w.grouped and (act_quant or backend not in ("auto", "xla")):
        raise LinearError("linear: per-group weight scales run W8A16 on the XLA path only "
                          f"(act_quant={act_quant}, backend={backend!r})")
    if x_scale is not None and (x.dtype != FP8 or not act_quant or act_group
                                or out_dtype is None or x_scale.shape != (M,)):
        raise LinearError("linear: a pre-quantized x (x_scale given) must be float8_e4m3fn "
                          f"[M, K] with x_scale [M] (got {x.dtype}, {x_scale.shape}), "
                          "act_quant=True, no act_group and an out_dtype")
    out_dtype = out_dtype or x.dtype
    cfg_group = triton_config.act_group if backend == "triton" and triton_config else 0
    if act_group and not act_quant:
        raise LinearError("linear: act_group needs act_quant=True (W8A8)")
    if act_group and backend not in ("triton", "xla"):
        raise LinearError(f"linear: act_group runs on backend 'triton' or 'xla', not {backend!r}")
    if cfg_group != (act_group if backend == "triton" else 0):
        raise LinearError(f"linear: act_group={act_group} but the triton config quantizes "
                          f"with act_group={cfg_group}")
    if x_scale is not None:  # quantized by the caller
        x_in = x
    elif act_group and backend == "xla":
        x_in, x_scale = quantize_row_groups_fp8(x, act_group)
    elif act_quant and not act_group:
        x_in, x_scale = quantize_rows_fp8(x)
    else:  # bf16, or quantized inside the Triton GEMM
        x_in, x_scale = x, None
    if backend == "auto":
        backend = "xla" if w.grouped else _pick_backend(M, K, Nw, jnp.dtype(w.w.dtype),
                                                        act_quant, w.gate_up)
    if backend == "triton":
        return triton_gemm.triton_linear(x_in, w.w, w.scale, x_scale, layer=layer,
                                         gate_up=w.gate_up, config=triton_config,
                                         out_dtype=out_dtype, interpret=interpret,
                                         unreduced=unreduced)
    w_nk, scale = w.w, w.scale
    if w.stacked:
        w_nk = w_nk[layer]
        scale = None if scale is None else scale[layer]
    if backend in ("mgpu", "mgpu_decode") and x_in.dtype != w_nk.dtype:
        raise LinearError(f"linear: backend {backend!r} needs x and w of one dtype "
                          "(bf16, or FP8 with act_quant=True)")
    if backend == "mgpu_decode":
        if not mgpu_gemm.mgpu_decode_supported(M, K, Nw, x_in.dtype):
            raise LinearError(
                f"linear: backend 'mgpu_decode' cannot take M={M} K={K} N={Nw} ({x_in.dtype}): "
                "it needs M <= 128 or 241 <= M <= 256, N % 64 == 0 and K a multiple of "
                "tile_k x split_k (mgpu_gemm.mgpu_decode_supported)")
        out = mgpu_gemm.mgpu_decode_linear(x_in, w_nk, scale, x_scale, config=mgpu_config,
                                           out_dtype=out_dtype if not w.gate_up else F32,
                                           interpret=interpret)
    elif backend == "mgpu":
        if not mgpu_gemm.mgpu_supported(M, K, Nw, x_in.dtype, mgpu_config):
            raise LinearError(f"linear: backend 'mgpu' cannot take M={M} K={K} N={Nw}")
        # bf16 out also for gate_up (a float32 epilogue tile would not fit shared memory).
        out = mgpu_gemm.mgpu_linear(x_in, w_nk, scale, x_scale, config=mgpu_config,
                                    out_dtype=out_dtype, interpret=interpret)
        if out.ndim == 3:  # split-K: float32 partials [split_k, M, N], scales applied
            out = jnp.sum(out, axis=0)
            out = out if w.gate_up else out.astype(out_dtype)
    else:
        out = _xla_linear(x_in, w_nk, scale, x_scale,
                          out_dtype if not w.gate_up else jnp.float32)
    return silu_mul_ref(out, out_dtype) if w.gate_up else out
