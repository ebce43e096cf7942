"""Prefill-shape GEMM on Hopper wgmma (Pallas Mosaic GPU), bf16 x bf16 or FP8 x FP8.

Adapted from JAX's ``jax/experimental/pallas/ops/gpu/hopper_matmul_mgpu.py`` (persistent,
warp-specialized: one TMA producer warpgroup feeding ``max_concurrent_steps`` shared-memory
stages to two wgmma consumer warpgroups; tiled, double-buffered TMA-store epilogue). Changes:

* the weight is in the prepared ``[N, K]`` layout and is handed to wgmma as a transposed
  (K-major) B tile — the only B layout FP8 wgmma accepts;
* FP8 epilogue: the float32 accumulator is multiplied by the per-token scale (rows) and the
  per-output-channel scale (columns) before the cast to bf16; both scale slices are fetched
  by TMA while the main loop runs;
* M is padded up to the CTA tile by the wrapper (rows of zeros; the padded rows are sliced
  off); N must be a multiple of the CTA tile and K of ``tile_k`` (``mgpu_supported``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.matmul.reference import FP8


@dataclasses.dataclass(frozen=True)
class MgpuConfig:
    """Tiles per compute warpgroup; the CTA tile is ``tile_m x (2 * tile_n)``."""

    tile_m: int = 128
    tile_n: int = 128
    tile_k: int = 128  # 128 bytes of FP8; use 64 for bf16
    max_concurrent_steps: int = 4
    epi_tile_m: int = 64
    epi_tile_n: int = 64
    grid_minor_n: bool = True  # walk tiles along N first
    grid_tile_width: int = 8
    split_k: int = 1  # > 1: float32 partial sums [split_k, M, N], summed by the caller


# ``tile_n`` of the CTA tiles where the default 128 x 256 tiling leaves SMs idle: with T
# CTA tiles of 128 x 256 and T' = 2T of 128 x 128, take the narrower tiles where they need at
# least 10 % less full-tile work in waves on the SMs, ceil(T' / SMs) / 2 < 0.9 ceil(T / SMs).
# At the 512-row decode bucket of the 8B shape (132 SMs) that takes o and down (64 CTA
# tiles: 0.5 vs 1 wave) and gate_up (448: 3.5 vs 4), not qkv (96: a tie); at 1024 rows the
# 8B and 70B qkv; at M >= 2048 none of the 8B or 70B projections. Measured in session 33
# (RESULTS.md "Session 33"), the 512-row FP8 + FP8-KV step on an H100: o 736 -> 476 us a
# step, down 2201 -> 1537, gate_up 3304 -> 3278; device busy 27.05 -> 26.24 ms (H200: 24.70
# -> 23.74; 1000 / 1000 x 512 end to end +1.9 % output tok/s). The rule "fewer CTA tiles than
# SMs" also took qkv (96 -> 192 CTAs, two waves): 791 -> 963 us. None turns it off.
FILL_TILE_N: int | None = 64


def default_config(dtype: jnp.dtype, M: int, N: int | None = None) -> MgpuConfig:
    """Tiles that fit Hopper's 227 KiB of shared memory for ``dtype`` operands: 128 x 256
    CTA tiles, or with :data:`FILL_TILE_N` set and ``N`` given, 128 x (2 * FILL_TILE_N)
    where that needs >= 10 % less work in waves than the 128 x 256 tiling of ``[M, N]``."""
    tile_k = 128 if jnp.dtype(dtype).itemsize == 1 else 64
    cfg = MgpuConfig(tile_m=128, tile_n=128, tile_k=tile_k, max_concurrent_steps=4)
    if FILL_TILE_N and N is not None and N % (2 * FILL_TILE_N) == 0:
        fill, sms = dataclasses.replace(cfg, tile_n=FILL_TILE_N), _num_sms()
        # waves x tile width: the work of a wave of narrow tiles counts FILL_TILE_N / tile_n
        if (pl.cdiv(_cta_tiles(M, N, fill), sms) * FILL_TILE_N
                < 0.9 * pl.cdiv(_cta_tiles(M, N, cfg), sms) * cfg.tile_n):
            cfg = fill
    return cfg


def mgpu_supported(M: int, K: int, N: int, dtype: jnp.dtype,
                   cfg: MgpuConfig | None = None) -> bool:
    """Whether :func:`mgpu_linear` takes these shapes (M is padded; N, K must divide)."""
    cfg = cfg or default_config(dtype, M, N)
    return M >= 1 and N % (2 * cfg.tile_n) == 0 and K % (cfg.tile_k * cfg.split_k) == 0 and \
        jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(FP8))


def _cta_tiles(M: int, N: int, cfg: MgpuConfig) -> int:
    """CTA tiles of ``[M, N]`` (M padded to ``tile_m``), split-K pieces not counted."""
    return pl.cdiv(M, cfg.tile_m) * (N // (2 * cfg.tile_n))


def _round_up(v: int, m: int) -> int:
    return -(-v // m) * m


def _num_sms() -> int:
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is not None and getattr(mesh, "abstract_device", None) is not None:
        return mesh.abstract_device.num_cores
    dev = jax.devices()[0]
    return getattr(dev, "core_count", 132) if dev.platform == "gpu" else 132


def _kernel(x_gmem, w_gmem, *rest, cfg: MgpuConfig, has_xs: bool, has_ws: bool,
            out_dtype):
    rest = list(rest)
    xs_gmem = rest.pop(0) if has_xs else None
    ws_gmem = rest.pop(0) if has_ws else None
    (out_gmem,) = rest
    m, k = x_gmem.shape
    n = w_gmem.shape[0]
    dtype = x_gmem.dtype
    tile_m, tile_n, tile_k = cfg.tile_m, cfg.tile_n, cfg.tile_k
    cta_tile_n = 2 * tile_n
    split = cfg.split_k
    k_per = k // split
    m_iters, n_iters, k_iters = m // tile_m, n // cta_tile_n, k_per // tile_k
    swizzle = plgpu.find_swizzle(tile_k * jnp.dtype(dtype).itemsize * 8)
    swizzle_elems = swizzle // jnp.dtype(dtype).itemsize
    transforms = (plgpu.TilingTransform((8, swizzle_elems)), plgpu.SwizzleTransform(swizzle))
    epi_m, epi_n = cfg.epi_tile_m, cfg.epi_tile_n
    num_out_slots = min(2, (tile_m * tile_n) // (epi_m * epi_n))
    out_swizzle = plgpu.find_swizzle(epi_n * jnp.dtype(out_dtype).itemsize * 8)
    out_transforms = (
        plgpu.TilingTransform((8, out_swizzle // jnp.dtype(out_dtype).itemsize)),
        plgpu.SwizzleTransform(out_swizzle))

    # A TMA copy's shared-memory address must be 128-byte aligned: each scale slice starts on
    # a 32-float boundary (a decode tile of 8 tokens, unpadded, put warpgroup 1's slices at
    # 288 / 544 bytes: "CUDA misaligned address" on the H200).
    seg_m, seg_n = _round_up(tile_m, 32), _round_up(tile_n, 32)

    def get_pipeline(body, compute_context):
        return plgpu.emit_pipeline_warp_specialized(
            body, grid=(k_iters,), memory_registers=40,
            in_specs=[
                plgpu.BlockSpec((tile_m, tile_k), lambda kk: (0, kk), transforms=transforms,
                                memory_space=plgpu.SMEM),
                plgpu.BlockSpec((cta_tile_n, tile_k), lambda kk: (0, kk),
                                transforms=transforms, memory_space=plgpu.SMEM),
            ],
            wg_axis="wg", num_compute_wgs=2,
            max_concurrent_steps=cfg.max_concurrent_steps, compute_context=compute_context)

    def ignore(*_, **__):  # a no-op body: get_allocations only needs the pipeline's shapes
        return None

    @functools.partial(
        pl.run_scoped,
        pipeline_allocs=get_pipeline(ignore, ignore).get_allocations(x_gmem, w_gmem),
        out_smem=plgpu.SMEM((2, num_out_slots, epi_m, epi_n), out_dtype,
                            transforms=out_transforms),
        scale_smem=plgpu.SMEM((2, seg_m + seg_n), jnp.float32),
        scale_barrier=plgpu.Barrier(num_barriers=4),
        collective_axes="wg")
    def _scope(pipeline_allocs, out_smem, scale_smem, scale_barrier):
        wg_idx = lax.axis_index("wg")

        @plgpu.nd_loop((m_iters * n_iters * split,), collective_axes="sm")
        def _mn_loop(loop_info: plgpu.NDLoopInfo):
            (lin_idx,) = loop_info.index
            s_idx = lax.rem(lin_idx, split)
            m_idx, n_idx = plgpu.planar_snake(
                lax.div(lin_idx, split), (m_iters, n_iters), 1 if cfg.grid_minor_n else 0,
                cfg.grid_tile_width)
            k_slice = pl.ds(s_idx * k_per, k_per)
            out_ref = out_gmem.at[s_idx] if split > 1 else out_gmem
            cta_m = pl.ds(m_idx * tile_m, tile_m)
            cta_n = pl.ds(n_idx * cta_tile_n, cta_tile_n)
            wg_n0 = n_idx * cta_tile_n + wg_idx * tile_n

            def compute_context(eval_pipeline):
                @functools.partial(pl.run_scoped,
                                   acc_ref=plgpu.ACC((tile_m, tile_n), jnp.float32))
                def _acc_scope(acc_ref):
                    xs_s = scale_smem.at[wg_idx, pl.ds(0, tile_m)]
                    ws_s = scale_smem.at[wg_idx, pl.ds(seg_m, tile_n)]
                    xs_bar = scale_barrier.at[2 * wg_idx]
                    ws_bar = scale_barrier.at[2 * wg_idx + 1]
                    if has_xs:
                        plgpu.copy_gmem_to_smem(xs_gmem.at[cta_m], xs_s, xs_bar)
                    if has_ws:
                        plgpu.copy_gmem_to_smem(ws_gmem.at[pl.ds(wg_n0, tile_n)], ws_s, ws_bar)
                    eval_pipeline(acc_ref)
                    acc = acc_ref[...]
                    if has_xs:
                        plgpu.barrier_wait(xs_bar)
                        acc = acc * lax.broadcast_in_dim(xs_s[...], (tile_m, tile_n), [0])
                    if has_ws:
                        plgpu.barrier_wait(ws_bar)
                        acc = acc * lax.broadcast_in_dim(ws_s[...], (tile_m, tile_n), [1])
                    acc = acc.astype(out_dtype)
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    for mi in range(tile_m // epi_m):
                        for ni in range(tile_n // epi_n):
                            slot = (mi * (tile_n // epi_n) + ni) % 2
                            plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                            out_smem[wg_idx, slot] = acc[mi * epi_m:(mi + 1) * epi_m,
                                                         ni * epi_n:(ni + 1) * epi_n]
                            plgpu.commit_smem()
                            plgpu.copy_smem_to_gmem(
                                out_smem.at[wg_idx, slot],
                                out_ref.at[pl.ds(m_idx * tile_m + mi * epi_m, epi_m),
                                           pl.ds(wg_n0 + ni * epi_n, epi_n)])

            def mma_body(_, a_smem, b_smem, acc_ref):
                b = b_smem.at[pl.ds(wg_idx * tile_n, tile_n)]
                plgpu.wgmma(acc_ref, a_smem, b.transpose((1, 0)))
                plgpu.wgmma_wait(0)
                return acc_ref

            get_pipeline(mma_body, compute_context)(
                x_gmem.at[cta_m, k_slice], w_gmem.at[cta_n, k_slice],
                allocations=pipeline_allocs)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def mgpu_linear(x: jax.Array, w_nk: jax.Array, w_scale: jax.Array | None = None,
                x_scale: jax.Array | None = None, *, config: MgpuConfig | None = None,
                out_dtype: jnp.dtype = jnp.bfloat16, interpret: bool = False) -> jax.Array:
    """``x [M, K] · w_nkᵀ`` -> ``[M, N]`` on wgmma, scales applied in the epilogue (JAX's
    hopper_matmul_mgpu.py, adapted: module docstring).

    Args:
      x: [M, K] bf16 (with a bf16 weight) or float8_e4m3fn with ``x_scale`` [M] f32.
      w_nk: [N, K], same dtype as ``x``; FP8 with ``w_scale`` [N] f32.
      config: tiles (:func:`default_config` of ``M`` and ``N`` when None).
      interpret: run the Mosaic GPU interpreter (CPU tests).
    Returns:
      [M, N] ``out_dtype``; with ``config.split_k > 1`` float32 partial sums
      ``[split_k, M, N]`` (scales already applied) for the caller to add up.
    Raises:
      ValueError: dtypes differ or are not bf16 / FP8, K differs, or N / K do not divide
        the tiles.
    """
    M, K = x.shape
    N, Kw = w_nk.shape
    if x.dtype != w_nk.dtype:
        raise ValueError(f"mgpu_linear: x is {x.dtype} but the weight is {w_nk.dtype}")
    if jnp.dtype(x.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(FP8)):
        raise ValueError(f"mgpu_linear: takes bfloat16 or float8_e4m3fn, got {x.dtype}")
    cfg = config or default_config(x.dtype, M, N)
    if K != Kw:
        raise ValueError(f"mgpu_linear: x has K={K} but the weight has K={Kw}")
    if not mgpu_supported(M, K, N, x.dtype, cfg):
        raise ValueError(f"mgpu_linear: N={N} must divide by {2 * cfg.tile_n} and K={K} by "
                         f"{cfg.tile_k * cfg.split_k} ({x.dtype})")
    m_pad = pl.cdiv(M, cfg.tile_m) * cfg.tile_m
    if m_pad != M:
        x = jnp.pad(x, ((0, m_pad - M), (0, 0)))
        if x_scale is not None:
            x_scale = jnp.pad(x_scale, (0, m_pad - M))
    args = [x, w_nk]
    if x_scale is not None:
        args.append(x_scale.astype(jnp.float32))
    if w_scale is not None:
        args.append(w_scale.astype(jnp.float32))
    if cfg.split_k > 1:
        out_dtype = jnp.float32
    kernel = functools.partial(_kernel, cfg=cfg, has_xs=x_scale is not None,
                               has_ws=w_scale is not None, out_dtype=out_dtype)
    out_shape = (m_pad, N) if cfg.split_k == 1 else (cfg.split_k, m_pad, N)
    params: dict = {"compiler_params": plgpu.CompilerParams(
        lowering_semantics=plgpu.LoweringSemantics.Warpgroup)}
    if interpret:
        params = {"interpret": plgpu.InterpretGPUParams()}
    f = plgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct(out_shape, out_dtype),
        grid=(min(_num_sms(), _cta_tiles(m_pad, N, cfg) * cfg.split_k),),
        grid_names=("sm",), num_threads=3, thread_name="wg",
        **params)
    out = f(*args)
    return out if m_pad == M else out[..., :M, :]


def mid_split_k(M: int, K: int, N: int, tile_k: int, tile_m: int = 128, tile_n: int = 256,
                num_sms: int = 132) -> int:
    """Split-K for :func:`mgpu_linear`'s prefill tiling at few rows: the smallest power of two
    that gives the ``ceil(M / tile_m) * N / tile_n`` CTA tiles at least one wave of
    ``num_sms`` (K / s a multiple of ``tile_k`` and >= 1024)."""
    tiles, s = -(-M // tile_m) * (N // tile_n), 1
    while tiles * s < num_sms and K % (tile_k * s * 2) == 0 and K // (s * 2) >= 1024:
        s *= 2
    return s


def mid_config(M: int, K: int, N: int, dtype: jnp.dtype) -> MgpuConfig:
    """:func:`mgpu_linear` tiles for 129-511 rows (measured on the H200 at 256: NOTES_matmul
    "Session 9"): 128 x 256 CTA tiles walked M first (the row tiles of one weight tile run
    together, so the second reads it from L2), split-K to one wave for small N, 3 pipeline
    stages when split (its float32 epilogue needs the shared memory)."""
    tile_k = 128 if jnp.dtype(dtype).itemsize == 1 else 64
    s = mid_split_k(M, K, N, tile_k)
    return MgpuConfig(tile_k=tile_k, grid_minor_n=False, grid_tile_width=16, split_k=s,
                      max_concurrent_steps=4 if s == 1 else 3)


def decode_split_k(K: int, N: int, tile_m: int, tile_k: int, m_pad: int, itemsize: int,
                   num_sms: int = 132, max_split: int = 16) -> int:
    """Split-K for the decode kernel from a byte model of the busiest SM.

    Each of the ``(N / tile_m) * s`` work units streams ``tile_m x K / s`` weight bytes plus
    a fixed cost (pipeline fill, epilogue: ~2 k-steps of bytes) and writes its float32 partial
    ``[tile_m, m_pad]``; the persistent grid gives the busiest SM ``ceil(units / num_sms)``
    units, and XLA reads all ``s`` partials back. Returns the power of two ``s`` (K / s >=
    512 and a multiple of ``tile_k``) minimizing that SM's bytes plus its share of the
    read-back, i.e. the wave-quantization loss traded against the partial-sum traffic.
    """
    best, best_cost = 1, None
    s = 1
    while s <= max_split and K % (tile_k * s) == 0 and (s == 1 or K // s >= 512):
        units = (N // tile_m) * s
        unit_bytes = tile_m * ((K // s + 2 * tile_k) * itemsize + m_pad * 4)
        cost = -(-units // num_sms) * unit_bytes + s * N * m_pad * 4 / num_sms
        if best_cost is None or cost < best_cost:
            best, best_cost = s, cost
        s *= 2
    return best


def decode_config(M: int, K: int, N: int, dtype: jnp.dtype, split_k: int | None = None,
                  stages: int = 8, tile_m: int = 64, num_sms: int = 132) -> MgpuConfig:
    """Tiles for :func:`mgpu_decode_linear`: ``tile_m`` weight rows (64 or 128, shared by
    both consumer warpgroups) x (M padded to 16k) tokens, split in two across them.

    ``split_k=None``: :func:`decode_split_k`. ``stages`` (TMA pipeline depth) is capped so
    the stages fit in 160 KiB of shared memory.
    """
    m_pad = max(16, -(-M // 16) * 16)
    itemsize = jnp.dtype(dtype).itemsize
    tile_k = 128 if itemsize == 1 else 64
    if split_k is None:
        split_k = decode_split_k(K, N, tile_m, tile_k, m_pad, itemsize, num_sms)
    per_stage = (tile_m + m_pad) * tile_k * itemsize
    stages = max(2, min(stages, (160 * 1024) // per_stage))  # leave room for the epilogue
    return MgpuConfig(tile_m=tile_m, tile_n=m_pad // 2, tile_k=tile_k,
                      max_concurrent_steps=stages, epi_tile_m=64,
                      epi_tile_n=min(64, m_pad // 2), grid_minor_n=False, grid_tile_width=1,
                      split_k=split_k)


def mgpu_decode_supported(M: int, K: int, N: int, dtype: jnp.dtype) -> bool:
    """Whether :func:`mgpu_decode_linear` takes the shape (M <= 256, N % 64, K % tile_k, and
    the tokens per warpgroup a multiple of the 64-wide epilogue tile above 64: M padded to
    16 up to 128 rows, exactly 256 above)."""
    cfg = decode_config(M, K, N, dtype)
    return M <= 256 and N % 64 == 0 and K % (cfg.tile_k * cfg.split_k) == 0 and \
        cfg.tile_n % cfg.epi_tile_n == 0 and \
        jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(FP8))


def mgpu_decode_linear(x: jax.Array, w_nk: jax.Array, w_scale: jax.Array | None = None,
                       x_scale: jax.Array | None = None, *, config: MgpuConfig | None = None,
                       out_dtype: jnp.dtype = jnp.bfloat16,
                       interpret: bool = False) -> jax.Array:
    """Decode GEMM on wgmma with A and B swapped ("swap-AB", as TensorRT-LLM's FP8 GEMV).

    wgmma's M is at least 64, so for a handful of tokens it computes ``outᵀ = w_nk · xᵀ``:
    64 (or 128) weight rows fill the MMA's M side and the tokens (padded to a multiple of 16) its N
    side, so no tensor-core work is spent on 64-row padding of x. Weights stream through
    TMA ``max_concurrent_steps`` deep; ``split_k`` fills the SMs for small N (float32
    partials added by XLA, fused with the transpose back to ``[M, N]``).

    Args and dtypes as :func:`mgpu_linear` (x and w of one dtype: bf16, or FP8 with both
    scales); ``config`` from :func:`decode_config`. Returns ``[M, N]`` in ``out_dtype``.
    Raises:
      ValueError: M above the config's padded token count, N not a multiple of
        ``config.tile_m`` (the weight would be padded, i.e. copied), or :func:`mgpu_linear`'s.
    """
    M, K = x.shape
    N = w_nk.shape[0]
    cfg = config or decode_config(M, K, N, x.dtype)
    m_pad = 2 * cfg.tile_n
    if M > m_pad:
        raise ValueError(f"mgpu_decode_linear: M={M} exceeds the config's {m_pad} tokens")
    if N % cfg.tile_m:
        raise ValueError(f"mgpu_decode_linear: N={N} is not a multiple of {cfg.tile_m} rows")
    if m_pad != M:
        x = jnp.pad(x, ((0, m_pad - M), (0, 0)))
        if x_scale is not None:
            x_scale = jnp.pad(x_scale, (0, m_pad - M), constant_values=1.0)
    # Roles swapped: the weight is the row operand (its scale scales rows), x the column one.
    # float32 out: a 16-token bf16 epilogue row (16 bytes) is below the smallest TMA swizzle.
    out_t = mgpu_linear(w_nk, x, x_scale, w_scale, config=cfg, out_dtype=jnp.float32,
                        interpret=interpret)
    if cfg.split_k > 1:
        out_t = jnp.sum(out_t, axis=0)
    return out_t[:, :M].T.astype(out_dtype)
