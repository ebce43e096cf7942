"""The engine's entry points for linear layers: ``prepare_weight``, ``linear``,
``linear_supported``.

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
import os

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

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
    Raises:
      LinearError: wrong rank, FP8 without a scale, or odd N with ``gate_up``.
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
    """Fuse ``w_gate, w_up [K, F]`` (or [L, K, F]) into one gate+up :class:`PreparedWeight`."""
    w = jnp.concatenate([w_gate, w_up], axis=-1)
    s = None if s_gate is None or s_up is None else jnp.concatenate([s_gate, s_up], axis=-1)
    return prepare_weight(w, s, gate_up=True)


def linear_supported(M: int, K: int, N: int, dtype: jnp.dtype, *,
                     act_quant: bool = False, gate_up: bool = False) -> bool:
    """Whether ``backend="auto"`` runs a Pallas kernel (not XLA) for this shape and weight dtype.

    ``dtype`` is the weight dtype (bf16 or float8_e4m3fn); N is the weight's row count.
    True only where a kernel measured faster than XLA (see :data:`AUTO_TRITON_MAX_M`).
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
           mgpu_config: mgpu_gemm.MgpuConfig | None = None) -> jax.Array:
    """A linear layer ``x @ W`` (with FP8 scaling / fused SwiGLU), dispatched to a kernel.

    Args:
      x: [M, K] bf16 activations.
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
    Returns:
      [M, N] in ``x.dtype`` ([M, F] for a gate_up weight: ``silu(gate) * up``).
    Raises:
      LinearError: unknown backend, mismatched K, act_quant with a bf16 weight, a stacked
        weight without ``layer``, per-group scales with act_quant or a kernel backend, a
        backend that cannot take the shape, or act_group without act_quant, on a backend
        other than triton / xla, or not matching the triton config.
    """
    if backend not in BACKENDS:
        raise LinearError(f"linear: unknown backend {backend!r}; choose from {BACKENDS}")
    if x.ndim != 2:
        raise LinearError(f"linear: x must be [M, K], got shape {x.shape}")
    if not isinstance(w, PreparedWeight):
        if backend not in ("auto", "xla"):
            raise LinearError(f"linear: backend {backend!r} needs a PreparedWeight "
                              "(call prepare_weight once at load time)")
        w = prepare_weight(w, w_scale) if w_scale is not None else PreparedWeight(
            w=jnp.swapaxes(w, -1, -2), scale=None)
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
    out_dtype = x.dtype
    cfg_group = triton_config.act_group if backend == "triton" and triton_config else 0
    if act_group and not act_quant:
        raise LinearError("linear: act_group needs act_quant=True (W8A8)")
    if act_group and backend not in ("triton", "xla"):
        raise LinearError(f"linear: act_group runs on backend 'triton' or 'xla', not {backend!r}")
    if cfg_group != (act_group if backend == "triton" else 0):
        raise LinearError(f"linear: act_group={act_group} but the triton config quantizes "
                          f"with act_group={cfg_group}")
    if act_group and backend == "xla":
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
                                         out_dtype=out_dtype, interpret=interpret)
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


# ----------------------------------------------------------------------------- engine policy
# The engine's FP8 projections on GPU, chosen by the program's static row count M from the
# H200 runs of benchmarks/kernels/bench_matmul.py (NOTES_matmul.md, session 4):
# * M >= FP8_PREFILL_MIN_M: W8A8 (x quantized per token) on the Mosaic GPU wgmma kernel,
#   1,013-1,428 TFLOP/s at M = 2048 on the Llama-3.1-8B / 70B projections (XLA bf16 <= 826);
# * M <= FP8_DECODE_MAX_M: W8A8 on the Triton kernel with swap-AB and the FP8 tensor-core dot
#   (the weight tile is the MMA's 64-row side, tokens padded to 16 on the other): W8A16 in
#   any form measured held to 1.2-2.6 TB/s of FP8 bytes (the per-element upcast and MMA
#   work), the FP8 dot consumes the bytes as they are (8B qkv M = 1: 12.9 µs vs XLA W8A16
#   19.3 µs);
# * between (the 128 / 256-row decode buckets, the 128-token prefill bucket): W8A8 on the
#   Mosaic GPU kernels (session 9, NOTES_matmul "Session 9"; XLA W8A16 before, 0.45-0.93 TB/s
#   at M = 256, slower than bf16): the swap-AB tiling (every token on wgmma's N side, each
#   weight byte read once) up to 128 rows, and at 241-256 rows for N < FP8_MID_WIDE_N;
#   128-row weight tiles at <= 128 rows where N > 4096; the prefill tiling walked M first
#   (mgpu_gemm.mid_config) for the rest (wide projections above 128 rows, and 129-240 rows,
#   which the swap-AB epilogue does not take; those row counts were not measured). 8B
#   layer at 256 rows: 148 µs vs 337 (XLA W8A16) and 189 (XLA bf16); 128 rows: 113 vs
#   175 / 146.
#   $JAXINFER_FP8_MID_GEMM=xla restores XLA W8A16 there.
FP8_PREFILL_MIN_M = 512
FP8_DECODE_MAX_M = 64
FP8_MID_GEMM = "mgpu"
FP8_MID_SWAP_MAX_M = 128
FP8_MID_WIDE_N = 16384
# Opt-in: rows FP8_MGPU_DECODE_MIN_M..FP8_DECODE_MAX_M on the Mosaic GPU swap-AB decode
# kernel (mgpu_gemm.mgpu_decode_linear, 128-row weight tiles where N allows) instead of the
# Triton one: 1.34-1.51x faster at M = 64 on 8b_gate_up / 8b_down / 70b_up alone on the H200
# (NOTES_matmul, session 7), but slower inside the 8B FP8 decode program (ITL +11 % / +13 % at
# 32 / 64 streams; NOTES_matmul "End to end (session 8)"), so not the default. "mgpu" turns
# it on; $JAXINFER_FP8_DECODE_GEMM overrides at trace time.
FP8_DECODE_GEMM = "triton"
FP8_MGPU_DECODE_MIN_M = 17
# The Triton decode GEMM's fusions (session 10, NOTES_matmul "Session 10"): "all" = x
# quantized to FP8 inside the GEMM per token and group of FP8_DECODE_ACT_GROUP input columns
# (no quantization kernels before it) + the split-K partials summed by the last split in the
# kernel (no epilogue fusion after it); "merge" = only the latter (x quantized per token by
# XLA first); "none" = neither (the session-4 kernel). Measured on the H200: "all" is 1.4-3.5x
# slower per GEMM (the quantized x goes registers -> shared memory every step and each group's
# dot is scaled before it is added: 8b_gate_up M = 1 52.4 vs 36.6 µs, M = 64 104 vs 68), the
# 8B FP8 batch-1 decode step 4.14 vs 3.50 ms of device time; "merge" 1-8 % slower per GEMM
# and end to end (TPOT p50 1 / 16 / 64 streams 4.43 / 4.24 / 6.54 vs 4.12 / 4.11 / 6.19 ms).
# Both stay opt-ins; $JAXINFER_FP8_DECODE_FUSE overrides at trace time.
FP8_DECODE_FUSE = "none"
FP8_DECODE_ACT_GROUP = 128
# Engine gate_up on the Triton decode GEMM with SwiGLU in its epilogue (gate and up tiles in
# one program: two weight streams per program) up to this many rows: H200, 8B FP8 batch 1,
# the gate_up GEMM 31.8 vs 39.3 µs a layer (decode-step profile, session 10); at 64 rows its
# split-K float32 partials ([2, 64, 28672]) made the step slower (TPOT 6.16-6.19 vs 5.74 ms),
# so above it the plain [M, 2F] GEMM and a SwiGLU fusion, as before.
FP8_GATE_UP_EPILOGUE_MAX_M = 16


def _env_choice(var: str, default: str, choices: tuple[str, ...]) -> str:
    v = os.environ.get(var, default)
    if v not in choices:
        raise LinearError(f"{var} / {var.removeprefix('JAXINFER_')}: one of {choices}, got {v!r}")
    return v


def _fp8_decode_gemm() -> str:
    return _env_choice("JAXINFER_FP8_DECODE_GEMM", FP8_DECODE_GEMM, ("triton", "mgpu"))


def _fp8_mid_gemm() -> str:
    return _env_choice("JAXINFER_FP8_MID_GEMM", FP8_MID_GEMM, ("mgpu", "xla"))


def _swap_ab_tile(M: int, N: int) -> int:
    """Weight rows per CTA of the Mosaic swap-AB kernel (measured best): 128 where N allows,
    in the middle band only up to FP8_MID_SWAP_MAX_M rows and for N > 4096."""
    if N % 128:
        return 64
    if M <= FP8_DECODE_MAX_M:
        return 128
    return 128 if M <= FP8_MID_SWAP_MAX_M and N > 4096 else 64


def _fp8_decode_fuse() -> str:
    return _env_choice("JAXINFER_FP8_DECODE_FUSE", FP8_DECODE_FUSE, ("all", "merge", "none"))


def fp8_decode_config(M: int, K: int, N: int, gate_up: bool = False,
                      fuse: str | None = None) -> triton_gemm.TritonConfig:
    """Swap-AB FP8-dot tiles for ``M <= FP8_DECODE_MAX_M`` tokens: 64 weight rows x 256 K
    per step, tokens padded to a power of two >= 16, split-K until ~2 waves of 132 SMs;
    ``N`` output columns (F for a gate_up weight). ``fuse`` (default
    ``$JAXINFER_FP8_DECODE_FUSE`` or :data:`FP8_DECODE_FUSE`): "all" quantizes x in the
    kernel per token and group of FP8_DECODE_ACT_GROUP columns (where the group divides K)
    and merges split-K in the kernel, "merge" only the latter, "none" neither.
    Raises LinearError for an unknown ``fuse``."""
    fuse = _fp8_decode_fuse() if fuse is None else fuse
    if fuse not in ("all", "merge", "none"):
        raise LinearError(f"fp8_decode_config: fuse must be all / merge / none, got {fuse!r}")
    bm = min(64, max(16, 1 << max(M - 1, 0).bit_length()))
    bn, bk = 64, 256
    while bk > 16 and K % bk:
        bk //= 2
    group = FP8_DECODE_ACT_GROUP if fuse == "all" and K % FP8_DECODE_ACT_GROUP == 0 else 0
    split = triton_gemm.split_to_fill(pl.cdiv(N, bn) * pl.cdiv(M, bm), K, bk)
    cfg = triton_gemm.TritonConfig(bm=bm, bn=bn, bk=bk, split_k=split, num_warps=4,
                                   num_stages=4, fp8_dot=True, swap_ab=True, act_group=group,
                                   merge=fuse != "none")
    cfg = triton_gemm.fit_smem(cfg, K, jnp.bfloat16 if group else FP8, FP8, gate_up)
    if group and cfg.bk % group:  # fit_smem went below the group: quantize outside
        return fp8_decode_config(M, K, N, gate_up, "merge")
    return cfg


def fp8_engine_plan(M: int, K: int, N: int) -> tuple[str, bool]:
    """``(backend, act_quant)`` of the engine's FP8 projection ``[M, K] x [N, K]ᵀ`` on GPU
    (module comment above): ``("mgpu", True)``, ``("mgpu_decode", True)`` (the middle band;
    at 17-64 rows opt-in, ``FP8_DECODE_GEMM``), ``("triton", True)`` or ``("xla", False)``.
    Raises LinearError for an unknown ``$JAXINFER_FP8_DECODE_GEMM`` / ``_MID_GEMM``."""
    decode_gemm, mid_gemm = _fp8_decode_gemm(), _fp8_mid_gemm()  # all checked at any M
    _fp8_decode_fuse()
    if M >= FP8_PREFILL_MIN_M and mgpu_gemm.mgpu_supported(M, K, N, FP8):
        return "mgpu", True
    if FP8_DECODE_MAX_M < M < FP8_PREFILL_MIN_M and mid_gemm == "mgpu":
        if ((M <= FP8_MID_SWAP_MAX_M or N < FP8_MID_WIDE_N)
                and mgpu_gemm.mgpu_decode_supported(M, K, N, FP8)):
            return "mgpu_decode", True
        if mgpu_gemm.mgpu_supported(M, K, N, FP8, mgpu_gemm.mid_config(M, K, N, FP8)):
            return "mgpu", True
    if (FP8_MGPU_DECODE_MIN_M <= M <= FP8_DECODE_MAX_M and decode_gemm == "mgpu"
            and mgpu_gemm.mgpu_decode_supported(M, K, N, FP8)):
        return "mgpu_decode", True
    if M <= FP8_DECODE_MAX_M and K % 16 == 0:
        return "triton", True
    return "xla", False


def fp8_engine_linear(x: jax.Array, w_nk: jax.Array, w_scale: jax.Array, *,
                      gate_up: bool = False, interpret: bool = False) -> jax.Array:
    """The engine's FP8 projection: ``x [M, K]`` bf16 times an FP8 weight ``w_nk [N, K]``
    with per-output-channel ``w_scale [N]`` f32 -> ``[M, N]`` in ``x.dtype``, on the kernel
    :func:`fp8_engine_plan` picks for M (W8A8 on the kernels: activation scales per token,
    or per token and group of K columns inside the Triton decode GEMM; W8A16 on XLA).
    ``gate_up``: ``w_nk`` is ``[2F, K]`` (gate rows first) and the result ``silu(gate) * up``
    ``[M, F]``: from the float32 accumulator in the Triton GEMM's epilogue (or its split-K
    epilogue fusion) up to FP8_GATE_UP_EPILOGUE_MAX_M rows, else from the ``[M, 2F]`` GEMM
    output in one XLA fusion.

    Raises:
      LinearError: mismatched shapes (see :func:`linear`), an odd gate_up row count.
    """
    M, K = x.shape
    N = w_nk.shape[0]
    if gate_up and N % 2:
        raise LinearError(f"fp8_engine_linear: a gate_up weight needs an even row count, got {N}")
    backend, act_quant = fp8_engine_plan(M, K, N)
    if gate_up and not (backend == "triton" and M <= FP8_GATE_UP_EPILOGUE_MAX_M):
        # [M, 2F] in x.dtype from the plain GEMM, then SwiGLU (one XLA fusion)
        return silu_mul_ref(fp8_engine_linear(x, w_nk, w_scale, interpret=interpret))
    tc, group = None, 0
    if act_quant and M <= FP8_DECODE_MAX_M and backend in ("triton", "xla"):
        # the Triton decode GEMM's activation groups (the same math where a caller's plan
        # puts these rows on XLA, e.g. a test's reference)
        tc = fp8_decode_config(M, K, N // 2 if gate_up else N, gate_up)
        group = tc.act_group
        tc = tc if backend == "triton" else None
    mc = None
    if backend == "mgpu_decode":
        mc = mgpu_gemm.decode_config(M, K, N, FP8, tile_m=_swap_ab_tile(M, N))
    elif backend == "mgpu" and M < FP8_PREFILL_MIN_M:
        mc = mgpu_gemm.mid_config(M, K, N, FP8)
    return linear(x, PreparedWeight(w_nk, w_scale, gate_up), act_quant=act_quant,
                  act_group=group, backend=backend, interpret=interpret, triton_config=tc,
                  mgpu_config=mc)
