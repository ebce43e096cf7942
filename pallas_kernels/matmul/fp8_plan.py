"""The engine's FP8 projections on GPU: which kernel (and tiles) each row count runs on,
measured on an H200 (benchmarks/kernels/NOTES_matmul.md), and :func:`fp8_engine_linear`, the
call the model makes (jaxinfer/models/transformer.py).

Kernel choices read environment variables at trace time (A/B runs; each is in the compile-
cache fingerprint, jaxinfer/compile_cache.KERNEL_ENV_VARS): ``$JAXINFER_FP8_DECODE_GEMM``,
``$JAXINFER_FP8_MID_GEMM``, ``$JAXINFER_FP8_DECODE_FUSE``, ``$JAXINFER_FP8_DECODE_DEEP_K``,
``$JAXINFER_FP8_DECODE_TILES``, ``$JAXINFER_FP8_DECODE_FAST_ACCUM``,
``$JAXINFER_FP8_DECODE_ROWS_AT_64``.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.matmul import mgpu_gemm, triton_gemm
from pallas_kernels.matmul.api import LinearError, PreparedWeight, linear
from pallas_kernels.matmul.reference import FP8, silu_mul_ref
from pallas_kernels.matmul.row_quant import row_quant_supported

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
# Deep K steps for the large weights at <= 16 tokens: 512 K columns a step in 3 stages instead
# of 256 in 4, where each program then still walks >= FP8_DECODE_DEEP_K_MIN_STEPS steps
# (70B up / down / o / qkv, 8B down; not the 4096-wide 8B shapes, 2 steps, nor gate_up, whose
# two weight tiles a step were not measured so). Session 4's grid (H200, bench_matmul --plan
# w8a8, record matmul_h200_s4call3_w8a8-20261201.json, x quantization included): 70b_up M=1
# 62.6 vs 76.4 us (3.75 vs 3.07 TB/s), M=16 64.3 vs 77.1; 8b_down M=1 21.8 vs 24.6, M=16
# 23.2 vs 25.8; 70b_o M=1 25.6 vs 26.4; 8b_qkv M=1 16.4 vs 12.9 (hence the step floor).
# Session 12 (call 4, the kernel alone as the engine calls it; record
# matmul_h200_s12call4_deepk-20261202.json): 70b_up M=1 59.2 vs 73.6 us (3.97 vs 3.19 TB/s),
# M=16 60.5 vs 73.8; 8b_down 19.1 / 19.5 vs 21.4 / 22.0; 70b_o 22.3 / 24.1 vs 23.5 / 24.5.
# Session 14 (NOTES_matmul "Session 14"): off by default again. Since session 13 the
# 256-deep steps run the FP8 dot on wgmma (FP8_DECODE_FAST_ACCUM below) and the 512-deep ones
# stay on mma.sync: 70B FP8 batch 1 end to end 18.97 ms a step without them vs 19.74 with
# (call 2, one process each), kernel alone at one token 70B down 56.6 vs 57.4 us, 70B o
# 19.2 vs 20.3, 8B down 17.2 vs 18.4 (call 3; only the unfused 70B up shape, which the engine
# does not run — its gate_up is fused — still gains: 59.4 vs 66.5).
# $JAXINFER_FP8_DECODE_DEEP_K=on takes the 512-deep steps (an A/B end to end).
FP8_DECODE_DEEP_K = False
FP8_DECODE_DEEP_K_MIN_STEPS = 4
# Split-K and tiles of the decode GEMM (session 13's sweep, bench_matmul --plan tiles, H200,
# record matmul_h200_s13call1_tiles-20261202.json; NOTES_matmul "Session 13"). "wave15":
# split-K only until the grid reaches FP8_DECODE_SPLIT_TARGET programs (1.5 waves of 132
# SMs; 2-3 programs fit an SM, so more splits add float32 partials, not bandwidth), and at
# >= 32 tokens 3 stages (one more program an SM) with 128-row weight tiles for N >= 16384
# (each x tile serves twice the weight rows). Kernel alone vs "wave2" (splits up to 2 waves,
# 64-row tiles, 4 stages): 8b gate_up M=16 32.7 vs 36.4 us, 70b_o M=16 20.8 vs 23.8, M=32
# 70b_up 59.6 vs 84.5, 8b gate_up (plain 2F) 32.6 vs 41.6, 8b_down 20.3 vs 25.2, 70b_o 22.5
# vs 28.6; M=64 70b_up 82.8 vs 93.4, gate_up 44.7 vs 49.7. $JAXINFER_FP8_DECODE_TILES=wave2
# restores session 12's tiles (an A/B end to end).
FP8_DECODE_TILES = "wave15"
FP8_DECODE_SPLIT_TARGET = 198
FP8_DECODE_WIDE_N = 16384
# The FP8 dot on wgmma (TritonConfig.fast_accum, fp8_fast_accum.py: Triton otherwise widens
# both FP8 operands to f16 for mma.sync) on the 256-deep K steps: 64-row weight tiles in 3
# stages, 128-row tiles at 64 tokens in 2 (MMAv3 keeps every stage in shared memory).
# Session 13, call 4 (bench_matmul --plan fastacc, H200, record
# matmul_h200_s13call4_fastacc-20261202.json; kernel alone, rel. L2 vs float32 6.6-8.6e-4
# against <= 4e-5 for mma.sync): 8B qkv
# 9.5 / 10.1 / 11.1 / 13.0 us at 1 / 16 / 32 / 64 tokens vs 10.1 / 10.9 / 12.3 / 15.2, 8B o
# 7.5-9.4 vs 8.0-11.6, 8B gate_up + SwiGLU 29.8 / 30.3 vs 31.6 / 32.0, at 64 tokens 70B up
# 72.1 vs 83.3, 8B down 20.7 vs 26.3, 70B o 22.7 vs 28.8. Slower on the 512-deep steps
# (70B up at 1 token 66.0 vs 58.4) and on 128-row tiles at 32 tokens (65.7 vs 59.2): those
# keep mma.sync. $JAXINFER_FP8_DECODE_FAST_ACCUM=off turns it off (an A/B end to end).
# Session 31 (bench_matmul --plan m64, H200, record matmul_h200_s31call4_m64-20261206.json):
# with the wgmma dot, 64-token tiles stream the wide weights faster on 64 weight rows in 3
# stages than on 128 in 2: 70B up 63.1 vs 72.0 us (3.72 TB/s), 8B gate_up (2F) 35.1 vs 39.7;
# at 32 tokens the 128-row mma.sync tiles stay (59.7 vs 70.9). FP8_DECODE_ROWS_AT_64 = 128
# ($JAXINFER_FP8_DECODE_ROWS_AT_64=128) gives session 13's tiles back (128 rows, 2 stages;
# an A/B end to end).
FP8_DECODE_FAST_ACCUM = True
FP8_DECODE_ROWS_AT_64 = 64


def _env_choice(var: str, default: str, choices: tuple[str, ...]) -> str:
    v = os.environ.get(var, default)
    if v not in choices:
        raise LinearError(f"${var}={v!r}: one of {choices}")
    return v


def env_values() -> dict[str, str]:
    """{variable: value in effect} of this module's environment switches (module docstring),
    defaults filled in. Raises LinearError for a value outside a switch's choices."""
    return {"JAXINFER_FP8_DECODE_GEMM": _fp8_decode_gemm(),
            "JAXINFER_FP8_MID_GEMM": _fp8_mid_gemm(),
            "JAXINFER_FP8_DECODE_FUSE": _fp8_decode_fuse(),
            "JAXINFER_FP8_DECODE_DEEP_K": "on" if _fp8_decode_deep_k() else "off",
            "JAXINFER_FP8_DECODE_TILES": _fp8_decode_tiles(),
            "JAXINFER_FP8_DECODE_FAST_ACCUM": "on" if _fp8_decode_fast_accum() else "off",
            "JAXINFER_FP8_DECODE_ROWS_AT_64": str(_fp8_decode_rows_at_64())}


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


def _fp8_decode_deep_k() -> bool:
    return _env_choice("JAXINFER_FP8_DECODE_DEEP_K", "on" if FP8_DECODE_DEEP_K else "off",
                       ("on", "off")) == "on"


def _fp8_decode_fast_accum() -> bool:
    return _env_choice("JAXINFER_FP8_DECODE_FAST_ACCUM",
                       "on" if FP8_DECODE_FAST_ACCUM else "off", ("on", "off")) == "on"


def _fp8_decode_rows_at_64() -> int:
    return int(_env_choice("JAXINFER_FP8_DECODE_ROWS_AT_64", str(FP8_DECODE_ROWS_AT_64),
                           ("64", "128")))


def _fp8_decode_tiles() -> str:
    return _env_choice("JAXINFER_FP8_DECODE_TILES", FP8_DECODE_TILES, ("wave15", "wave2"))


def fp8_decode_config(M: int, K: int, N: int, gate_up: bool = False,
                      fuse: str | None = None,
                      deep_k: bool | None = None,
                      tiles: str | None = None) -> triton_gemm.TritonConfig:
    """Swap-AB FP8-dot tiles for ``M <= FP8_DECODE_MAX_M`` tokens: 64 weight rows x 256 K
    per step, tokens padded to a power of two >= 16; ``tiles`` (default
    ``$JAXINFER_FP8_DECODE_TILES`` or :data:`FP8_DECODE_TILES`, see there) "wave15": split-K
    until FP8_DECODE_SPLIT_TARGET programs, at >= 32 tokens 3 stages and 128 weight rows
    where N >= FP8_DECODE_WIDE_N (not at 64 tokens with the wgmma dot), and the FP8 dot on
    wgmma (``fast_accum``) on the 256-deep steps of 64-row weight tiles where
    :data:`FP8_DECODE_FAST_ACCUM` says; "wave2": split-K until 2 waves of 132
    SMs, 4 stages;
    512 K a step in 3 stages for large weights at <= 16 tokens (``deep_k``, default
    ``$JAXINFER_FP8_DECODE_DEEP_K`` on / off or :data:`FP8_DECODE_DEEP_K`; see there); ``N``
    output columns (F for a gate_up weight).
    ``fuse`` (default
    ``$JAXINFER_FP8_DECODE_FUSE`` or :data:`FP8_DECODE_FUSE`): "all" quantizes x in the
    kernel per token and group of FP8_DECODE_ACT_GROUP columns (where the group divides K)
    and merges split-K in the kernel, "merge" only the latter, "none" neither.
    Raises LinearError for an unknown ``fuse`` / ``tiles`` or an unknown value of an
    environment switch it reads (module docstring)."""
    fuse = _fp8_decode_fuse() if fuse is None else fuse
    if fuse not in ("all", "merge", "none"):
        raise LinearError(f"fp8_decode_config: fuse must be all / merge / none, got {fuse!r}")
    tiles = _fp8_decode_tiles() if tiles is None else tiles
    if tiles not in ("wave15", "wave2"):
        raise LinearError(f"fp8_decode_config: tiles must be wave15 / wave2, got {tiles!r}")
    wave15 = tiles == "wave15"
    target = FP8_DECODE_SPLIT_TARGET if wave15 else 264
    bm = min(64, max(16, 1 << max(M - 1, 0).bit_length()))
    bn, bk, stages = 64, 256, 4
    group = FP8_DECODE_ACT_GROUP if fuse == "all" and K % FP8_DECODE_ACT_GROUP == 0 else 0
    fast_ok = wave15 and not group and K % 256 == 0 and _fp8_decode_fast_accum()
    if wave15 and bm >= 32:  # 128-row tiles for wide N, except 64 tokens on wgmma dots
        wide = N >= FP8_DECODE_WIDE_N and not (bm == 64 and fast_ok
                                                and _fp8_decode_rows_at_64() == 64)
        bn, stages = (128 if wide else 64), 3
    while bk > 16 and K % bk:
        bk //= 2
    n_tiles = pl.cdiv(N, bn) * pl.cdiv(M, bm)
    split = triton_gemm.split_to_fill(n_tiles, K, bk, target)
    deep_k = _fp8_decode_deep_k() if deep_k is None else deep_k
    if deep_k and bm == 16 and not gate_up and not group and K % 512 == 0:
        split_deep = triton_gemm.split_to_fill(n_tiles, K, 512, target)
        if K // (split_deep * 512) >= FP8_DECODE_DEEP_K_MIN_STEPS:
            bk, split, stages = 512, split_deep, 3
    fast = False
    if fast_ok and bk == 256 and (bn == 64 or bm == 64):  # bn 128 at 64 tokens: ROWS_AT_64
        fast, stages = True, 3 if bn == 64 else 2
    cfg = triton_gemm.TritonConfig(bm=bm, bn=bn, bk=bk, split_k=split, num_warps=4,
                                   num_stages=stages, fp8_dot=True, swap_ab=True,
                                   act_group=group, merge=fuse != "none", fast_accum=fast)
    cfg = triton_gemm.fit_smem(cfg, K, jnp.bfloat16 if group else FP8, FP8, gate_up)
    if group and cfg.bk % group:  # fit_smem went below the group: quantize outside
        return fp8_decode_config(M, K, N, gate_up, "merge")
    return cfg


def fp8_engine_plan(M: int, K: int, N: int) -> tuple[str, bool]:
    """``(backend, act_quant)`` of the engine's FP8 projection ``[M, K] x [N, K]ᵀ`` on GPU
    (module comment above): ``("mgpu", True)``, ``("mgpu_decode", True)`` (the middle band;
    at 17-64 rows opt-in, ``FP8_DECODE_GEMM``), ``("triton", True)`` or ``("xla", False)``.
    Raises LinearError for an unknown value of any of the module's ``$JAXINFER_FP8_*``
    switches (:func:`env_values`), checked at any M."""
    decode_gemm, mid_gemm = _fp8_decode_gemm(), _fp8_mid_gemm()  # all checked at any M
    env_values()
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


def fp8_takes_quantized_x(M: int, K: int, N: int, gate_up: bool = False) -> bool:
    """Whether :func:`fp8_engine_linear` takes ``x`` already quantized per token (``x_scale``):
    where the plan puts the ``[M, K] x [N, K]ᵀ`` projection on the Triton decode GEMM with
    per-token activation scales (no in-kernel groups) and ``row_quant.norm_quant_fp8`` takes
    K — the engine then quantizes (and RMS-normalizes) in that one kernel instead of XLA's
    two or three. Raises LinearError as :func:`fp8_engine_plan`."""
    backend, act_quant = fp8_engine_plan(M, K, N)
    if backend != "triton" or not act_quant or not row_quant_supported(K):
        return False
    return fp8_decode_config(M, K, N // 2 if gate_up else N, gate_up).act_group == 0


def fp8_gate_up_in_epilogue(M: int, K: int, N: int) -> bool:
    """Whether :func:`fp8_engine_linear` with ``gate_up`` (``[N = 2F, K]`` weight) computes
    ``silu(gate) * up`` in the Triton decode GEMM's epilogue (up to
    FP8_GATE_UP_EPILOGUE_MAX_M rows), not from the plain GEMM's ``[M, 2F]`` output.
    Raises LinearError as :func:`fp8_engine_plan`."""
    return fp8_engine_plan(M, K, N)[0] == "triton" and M <= FP8_GATE_UP_EPILOGUE_MAX_M


def fp8_engine_linear(x: jax.Array, w_nk: jax.Array, w_scale: jax.Array, *,
                      gate_up: bool = False, interpret: bool = False,
                      x_scale: jax.Array | None = None,
                      out_dtype: jnp.dtype = jnp.bfloat16,
                      unreduced: bool = False) -> jax.Array | triton_gemm.SplitKPartials:
    """The engine's FP8 projection: ``x [M, K]`` bf16 times an FP8 weight ``w_nk [N, K]``
    with per-output-channel ``w_scale [N]`` f32 -> ``[M, N]`` in ``x.dtype``, on the kernel
    :func:`fp8_engine_plan` picks for M (W8A8 on the kernels: activation scales per token,
    or per token and group of K columns inside the Triton decode GEMM; W8A16 on XLA).
    ``gate_up``: ``w_nk`` is ``[2F, K]`` (gate rows first) and the result ``silu(gate) * up``
    ``[M, F]``: from the float32 accumulator in the Triton GEMM's epilogue (or its split-K
    epilogue fusion) up to FP8_GATE_UP_EPILOGUE_MAX_M rows, else from the ``[M, 2F]`` GEMM
    output in one XLA fusion.

    ``x_scale``: ``x`` is float8_e4m3fn, quantized per token by the caller with these [M]
    scales (where :func:`fp8_takes_quantized_x`); the result is then ``out_dtype`` (the
    activations' dtype before quantization).

    ``unreduced``: where the plan's Triton decode GEMM splits K, return its
    ``triton_gemm.SplitKPartials`` for the consumer to sum (not with gate_up).

    Raises:
      LinearError: mismatched shapes (see :func:`linear`), an odd gate_up row count, an
        x_scale where the plan does not take a quantized x, or an unknown
        ``$JAXINFER_FP8_*`` value (:func:`fp8_engine_plan`).
    """
    if x.ndim != 2 or w_nk.ndim != 2:
        raise LinearError(f"fp8_engine_linear: x must be [M, K] and the weight [N, K], got "
                          f"{x.shape} and {w_nk.shape}")
    M, K = x.shape
    N = w_nk.shape[0]
    if x_scale is not None and not fp8_takes_quantized_x(M, K, N, gate_up):
        raise LinearError(f"fp8_engine_linear: the plan for M={M} K={K} N={N} does not take "
                          "a pre-quantized x (fp8_takes_quantized_x)")
    if gate_up and N % 2:
        raise LinearError(f"fp8_engine_linear: a gate_up weight needs an even row count, got {N}")
    backend, act_quant = fp8_engine_plan(M, K, N)
    if gate_up and not fp8_gate_up_in_epilogue(M, K, N):
        # [M, 2F] in x.dtype from the plain GEMM, then SwiGLU (one XLA fusion)
        return silu_mul_ref(fp8_engine_linear(x, w_nk, w_scale, interpret=interpret,
                                              x_scale=x_scale, out_dtype=out_dtype))
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
                  mgpu_config=mc, x_scale=x_scale,
                  out_dtype=out_dtype if x_scale is not None else None,
                  unreduced=unreduced and not gate_up)
