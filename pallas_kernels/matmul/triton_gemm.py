"""Skinny GEMM for decode shapes (M = 1..256) in Pallas' Triton lowering.

Computes ``out[m, n] = x_scale[m] * w_scale[n] * sum_k x[m, k] * w_nk[n, k]`` (scales
optional) with the weight in the prepared ``[N, K]`` layout (see ``reference.py``), or, with
``gate_up=True``, ``silu(gate) * up`` from a ``[2F, K]`` weight (gate rows first).

Design (the usual GEMV/skinny-GEMM decomposition, as in Triton's matmul tutorial and
vLLM's/ SGLang's Triton FP8 GEMMs):

* grid ``(cdiv(N, bn), cdiv(M, bm), split_k)``; each program owns a ``[bm, bn]`` output tile
  and walks its share of K in ``bk`` steps inside a ``fori_loop`` that Triton software-
  pipelines ``num_stages`` deep (cp.async into shared memory);
* each step loads ``x[bm, bk]`` and ``w[bn, bk]`` — rows of ``bk`` contiguous elements of the
  ``[N, K]`` weight — and does a tensor-core ``dot`` with a float32 accumulator; FP8 weights
  are upcast to bf16 in registers (exact), FP8 activations too unless ``fp8_dot`` (then the
  FP8 tensor-core path is used, which needs bm >= 64 on Hopper);
* ragged M and N are handled with load/store masks (no padding copies); K must be a multiple
  of ``split_k * bk``;
* epilogue (split_k == 1): per-token scale, per-channel scale, optional SiLU(gate)*up, cast,
  masked store. With ``split_k > 1`` the kernel writes float32 partials ``[split_k, M, Nw]``
  and the (tiny) reduction + epilogue runs as one XLA fusion, or, with ``merge=True``, the
  last-arriving split of each output tile reduces them in the kernel (one launch; the
  arrival counting of ``paged_attention/decode_merge.py``);
* ``act_group`` (W8A8 from bf16 activations, no quantization kernel before the GEMM): each
  step quantizes its ``x[bm, act_group]`` slices to e4m3 with one absmax scale per token and
  group (DeepSeek-V3's 1 x 128 activation tiles, vLLM's ``per_token_group_quant_fp8``), runs
  the FP8 dot per group and adds it to the float32 accumulator times the group's scales.

A stacked weight ``[L, Nw, K]`` (per-layer weights under the engine's scan) is read in place
at ``layer`` (an int32 scalar), so no per-layer slice is copied.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.matmul import fp8_fast_accum
from pallas_kernels.matmul.reference import FP8, quantize_rows_fp8
from pallas_kernels.matmul.splitk import SplitKPartials, splitk_epilogue_row, xla_epilogue

__all__ = ["SplitKPartials", "TritonConfig", "default_config", "fit_smem", "smem_bytes",
           "split_to_fill", "splitk_epilogue_row", "triton_linear"]


@dataclasses.dataclass(frozen=True)
class TritonConfig:
    """Tile sizes and launch parameters (all powers of two; bm, bn, bk >= 16)."""

    bm: int = 16
    bn: int = 32
    bk: int = 256
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4
    fp8_dot: bool = False  # FP8 x FP8 tensor-core dot (only when both operands are FP8)
    # Swap-AB (as TensorRT-LLM's and vLLM's small-M GEMMs): compute outᵀ = W·xᵀ, the weight
    # tile [bn, bk] as the MMA's A operand, which Hopper's wgmma may take from registers, so
    # an FP8 weight upcast in registers feeds the tensor cores without a trip through shared
    # memory; tokens (bm >= 16) sit on the MMA's N side.
    swap_ab: bool = False
    # FP8 -> bf16 by bit placement (Marlin's dequantization, vLLM fp8_marlin): e4m3's 7
    # exponent+mantissa bits shifted into bf16's, sign moved, then one multiply by 2^120 to
    # fix the exponent bias (exact, subnormals included), instead of Triton's
    # fp8 -> f16 -> f32 -> bf16 conversion chain.
    fast_dequant: bool = False
    # In-kernel FP8 quantization of bf16 activations per (token, group of act_group K
    # columns); 0 = off (x arrives FP8 with per-token scales, or the dot is not FP8).
    act_group: int = 0
    # split_k > 1: the last split of each output tile to finish sums the float32 partials
    # and runs the epilogue in the kernel (else one XLA fusion after it).
    merge: bool = False
    # FP8 dot on wgmma with its accumulator added into float32 every 128 K elements
    # (fp8_fast_accum.py); without it Triton widens both FP8 operands to f16 for mma.sync.
    fast_accum: bool = False


SMEM_BUDGET = 200 * 1024  # bytes of Hopper's 227 KiB the pipelined tiles may take


def smem_bytes(cfg: TritonConfig, x_dtype: jnp.dtype, w_dtype: jnp.dtype,
               gate_up: bool = False) -> int:
    """Shared memory the software pipeline keeps: ``num_stages`` copies of the x and w tiles."""
    per_stage = cfg.bm * cfg.bk * jnp.dtype(x_dtype).itemsize + \
        (2 if gate_up else 1) * cfg.bn * cfg.bk * jnp.dtype(w_dtype).itemsize
    return cfg.num_stages * per_stage


def fit_smem(cfg: TritonConfig, K: int, x_dtype: jnp.dtype, w_dtype: jnp.dtype,
             gate_up: bool = False) -> TritonConfig:
    """Halve bk (then drop to 3 stages) until the pipeline fits :data:`SMEM_BUDGET`."""
    while smem_bytes(cfg, x_dtype, w_dtype, gate_up) > SMEM_BUDGET:
        if cfg.bk > 64:
            cfg = dataclasses.replace(cfg, bk=cfg.bk // 2)
        elif cfg.num_stages > 2:
            cfg = dataclasses.replace(cfg, num_stages=cfg.num_stages - 1)
        else:
            break
    return cfg


def split_to_fill(programs: int, K: int, bk: int, target: int = 264) -> int:
    """Split-K factor (a power of two) that brings ``programs`` output tiles up to ``target``
    programs (default 2 waves of an H100/H200's 132 SMs), keeping K a multiple of
    ``split * bk`` and at least 1024 K per split."""
    split = 1
    while programs * split < target and K % (split * 2 * bk) == 0 and K // (split * 2) >= 1024:
        split *= 2
    return split


def default_config(M: int, K: int, N_out: int, w_dtype: jnp.dtype, x_dtype: jnp.dtype,
                   gate_up: bool = False) -> TritonConfig:
    """Heuristic tiles for an H100/H200 (132 SMs); benchmarks/kernels/bench_matmul.py tunes."""
    wb = jnp.dtype(w_dtype).itemsize
    if M <= 16:
        bm, bn, warps = 16, (16 if gate_up else 32), 4
    elif M <= 32:
        bm, bn, warps = 32, 32, 4
    elif M <= 64:
        bm, bn, warps = 64, 64, 4
    else:
        bm, bn, warps = 64, 128, 8
    bk = 256 if wb == 2 else 512
    if bm >= 64:
        bk = 128 if wb == 2 else 256
    while bk > 16 and K % bk:
        bk //= 2
    split = split_to_fill(pl.cdiv(N_out, bn) * pl.cdiv(M, bm), K, bk)
    both_fp8 = w_dtype == FP8 and x_dtype == FP8
    cfg = TritonConfig(bm=bm, bn=bn, bk=bk, split_k=split, num_warps=warps, num_stages=4,
                       fp8_dot=both_fp8 and bm >= 64)
    return fit_smem(cfg, K, x_dtype, w_dtype, gate_up)


BIAS_FIX = 2.0 ** 120  # 2^(127 - 7): bf16's exponent bias minus e4m3's


def fp8_bits_to_bf16(w: jax.Array) -> jax.Array:
    """float8_e4m3fn -> bfloat16, exactly, with integer ops and one multiply.

    e4m3 ``s eeee mmm`` becomes bf16 ``s 0000eeee mmm0000`` (value ``2^-120`` times the
    e4m3 value, subnormals included, as both formats' subnormals scale the same way), then
    ``* 2^120``. NaN (0x7F / 0xFF) is not preserved (e4m3fn weights from absmax scaling
    have none). Source: Marlin / vLLM ``fp8_marlin`` dequantization.
    """
    u = jax.lax.bitcast_convert_type(w, jnp.uint8).astype(jnp.uint16)
    bits = ((u & 0x7F) << 4) | ((u & 0x80) << 8)
    return jax.lax.bitcast_convert_type(bits, jnp.bfloat16) * jnp.bfloat16(BIAS_FIX)


def _kernel(*refs, M: int, Nw: int, K: int, F: int, cfg: TritonConfig, gate_up: bool,
            stacked: bool, has_ws: bool, has_xs: bool, partial: bool, compute_dtype,
            interpret: bool):
    it = iter(refs)
    layer_ref = next(it) if stacked else None
    x_ref = next(it)
    w_ref = next(it)
    ws_ref = next(it) if has_ws else None
    xs_ref = next(it) if has_xs else None
    if cfg.merge and partial:
        next(it)  # the zero counters input (aliased to cnt_ref)
    o_ref = next(it)
    part_ref = next(it) if cfg.merge and partial else o_ref
    cnt_ref = next(it) if cfg.merge and partial else None
    bm, bn, bk = cfg.bm, cfg.bn, cfg.bk
    pn, pm, ps = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    if stacked:
        layer = layer_ref[0]
        w_ref = w_ref.at[layer]
        if has_ws:
            ws_ref = ws_ref.at[layer]
    n_out = F if gate_up else Nw
    rows = pm * bm + jnp.arange(bm, dtype=jnp.int32)
    cols = pn * bn + jnp.arange(bn, dtype=jnp.int32)
    # Masks only where the tiles do not divide the array (masked-off rows/columns of x and w
    # only feed output rows/columns that are masked on store, so no fill value is needed).
    rmask = rows < M if M % bm else None
    cmask = cols < n_out if n_out % bn else None
    k_per = K // cfg.split_k
    k0 = ps * k_per
    row_starts = [pn * bn] + ([F + pn * bn] if gate_up else [])

    def load_w(start, ks):
        wt = plt.load(w_ref.at[pl.ds(start, bn), ks],
                      mask=None if cmask is None else cmask[:, None])
        if wt.dtype == compute_dtype:
            return wt
        if cfg.fast_dequant and wt.dtype == FP8 and compute_dtype == jnp.bfloat16:
            return fp8_bits_to_bf16(wt)
        return wt.astype(compute_dtype)

    fast = (fp8_fast_accum.FAST_ACCUM if cfg.fast_accum and compute_dtype == FP8
            and not interpret else None)

    def dot(wt, xt):  # [bn, bm] (swap-AB) or [bm, bn], float32
        a, b = (wt, xt) if cfg.swap_ab else (xt, wt)
        return plt.dot(a, b, trans_b=True, precision=fast)

    def body(i, accs):
        if cfg.act_group:  # quantize each group of x in registers, FP8 dot per group
            g = cfg.act_group
            for j in range(bk // g):
                ks = pl.ds(pl.multiple_of(k0 + i * bk + j * g, g), g)
                xq, xs = quantize_rows_fp8(plt.load(  # per token of this group
                    x_ref.at[pl.ds(pm * bm, bm), ks],
                    mask=None if rmask is None else rmask[:, None]))
                xs = xs[None, :] if cfg.swap_ab else xs[:, None]
                accs = tuple(acc + dot(load_w(s, ks), xq) * xs
                             for acc, s in zip(accs, row_starts))
            return accs
        ks = pl.ds(pl.multiple_of(k0 + i * bk, bk), bk)
        xt = plt.load(x_ref.at[pl.ds(pm * bm, bm), ks],
                      mask=None if rmask is None else rmask[:, None])
        if xt.dtype != compute_dtype:
            xt = xt.astype(compute_dtype)
        return tuple(acc + dot(load_w(s, ks), xt) for acc, s in zip(accs, row_starts))

    acc_shape = (bn, bm) if cfg.swap_ab else (bm, bn)
    zeros = tuple(jnp.zeros(acc_shape, jnp.float32) for _ in row_starts)
    accs = jax.lax.fori_loop(0, k_per // bk, body, zeros)
    if cfg.swap_ab:
        accs = tuple(a.T for a in accs)
    if rmask is None and cmask is None:
        omask = None
    elif rmask is None:
        omask = jnp.broadcast_to(cmask[None, :], (bm, bn))
    elif cmask is None:
        omask = jnp.broadcast_to(rmask[:, None], (bm, bn))
    else:
        omask = rmask[:, None] & cmask[None, :]

    def epilogue(accs):
        if has_xs:
            xs = plt.load(xs_ref.at[pl.ds(pm * bm, bm)], mask=rmask)
            accs = tuple(a * xs[:, None] for a in accs)
        if has_ws:
            accs = tuple(a * plt.load(ws_ref.at[pl.ds(s, bn)], mask=cmask)[None, :]
                         for a, s in zip(accs, row_starts))
        if gate_up:
            g, u = accs
            out = g * jax.nn.sigmoid(g) * u
        else:
            (out,) = accs
        plt.store(o_ref.at[pl.ds(pm * bm, bm), pl.ds(pn * bn, bn)], out.astype(o_ref.dtype),
                  mask=omask)

    if not partial:
        epilogue(accs)
        return
    # part_ref: [split_k, M, Nw] float32 partial sums
    for acc, s in zip(accs, row_starts):
        plt.store(part_ref.at[ps, pl.ds(pm * bm, bm), pl.ds(s, bn)], acc, mask=omask)
    if not cfg.merge:
        return  # the epilogue runs in XLA
    # Last-arriving split sums the tile's partials (memory ordering as decode_merge.py:
    # barrier, acq_rel gpu-scope atomic, barrier; plain loads from L2 after the acquire).
    if not interpret:  # the interpreter has no barrier (and runs programs in order)
        plt.debug_barrier()
    old = plt.atomic_add(cnt_ref, (pn, pm), jnp.ones((), jnp.int32))
    if not interpret:
        plt.debug_barrier()

    @pl.when(old == cfg.split_k - 1)
    def _merge():
        sums = []
        for s in row_starts:
            tot = jnp.zeros((bm, bn), jnp.float32)
            for p in range(cfg.split_k):  # fixed order: the result does not depend on arrival
                tot = tot + plt.load(part_ref.at[jnp.int32(p), pl.ds(pm * bm, bm), pl.ds(s, bn)],
                                     mask=omask)  # masked-off elements are not stored
            sums.append(tot)
        epilogue(tuple(sums))
        plt.store(cnt_ref.at[pn, pm], jnp.zeros((), jnp.int32))  # zeros in, zeros out


def triton_linear(x: jax.Array, w_nk: jax.Array, w_scale: jax.Array | None = None,
                  x_scale: jax.Array | None = None, *, layer: jax.Array | int | None = None,
                  gate_up: bool = False, config: TritonConfig | None = None,
                  out_dtype: jnp.dtype = jnp.bfloat16, interpret: bool = False,
                  unreduced: bool = False) -> jax.Array | SplitKPartials:
    """Skinny GEMM ``x [M, K] · w_nkᵀ`` -> ``[M, N]`` (``[M, F]`` for ``gate_up``): Triton's
    matmul-tutorial tiling with split-K (module docstring; vLLM's / SGLang's Triton FP8 GEMMs).

    Args:
      x: [M, K] bf16, or float8_e4m3fn with ``x_scale`` [M] f32. With ``config.act_group``
        bf16/f32 (quantized to e4m3 in the kernel per token and group of K columns).
      w_nk: [Nw, K] (or stacked [L, Nw, K] with ``layer``) bf16 or float8_e4m3fn.
      w_scale: [Nw] (or [L, Nw]) f32 per-output-channel scale, or None.
      layer: int32 scalar selecting the layer of a stacked weight.
      gate_up: ``w_nk`` is ``[2F, K]`` (gate rows, then up rows); returns ``silu(g) * u``.
      config: tiles; :func:`default_config` when None.
      unreduced: where the config splits K without the in-kernel merge (and not gate_up),
        return the :class:`SplitKPartials` instead of summing them (XLA's epilogue fusion).
    Returns: [M, N] (or [M, F]) in ``out_dtype``, or the :class:`SplitKPartials`.
    Raises:
      ValueError: mismatched K, a stacked weight without ``layer``, odd rows with gate_up, K
        not a multiple of ``split_k * bk``, FP8 x / w without x_scale / w_scale, or
        ``act_group`` without an FP8 weight, with FP8 / scaled x, < 16 or not dividing ``bk``.
    """
    stacked = w_nk.ndim == 3
    M, K = x.shape
    Nw, Kw = w_nk.shape[-2:]
    if Kw != K:
        raise ValueError(f"triton_linear: x has K={K} but weight has K={Kw}")
    if stacked and layer is None:
        raise ValueError("triton_linear: a stacked [L, N, K] weight needs `layer`")
    if gate_up and Nw % 2:
        raise ValueError(f"triton_linear: gate_up weight needs an even row count, got {Nw}")
    F = Nw // 2 if gate_up else 0
    n_out = F if gate_up else Nw
    cfg = config or default_config(M, K, n_out, w_nk.dtype, x.dtype, gate_up)
    if K % (cfg.split_k * cfg.bk):
        raise ValueError(f"triton_linear: K={K} is not a multiple of split_k*bk="
                         f"{cfg.split_k * cfg.bk}")
    if cfg.act_group and (w_nk.dtype != FP8 or x.dtype == FP8 or x_scale is not None
                          or cfg.bk % cfg.act_group or cfg.act_group < 16):
        raise ValueError(
            f"triton_linear: act_group={cfg.act_group} needs an FP8 weight, unscaled bf16/f32 "
            f"x (got {x.dtype}, x_scale {'given' if x_scale is not None else 'None'}) and a "
            f"group of >= 16 dividing bk={cfg.bk}")
    if x.dtype == FP8 and x_scale is None:
        raise ValueError("triton_linear: FP8 activations need x_scale")
    if w_nk.dtype == FP8 and w_scale is None:
        raise ValueError("triton_linear: FP8 weights need w_scale")
    if cfg.act_group or (x.dtype == FP8 and w_nk.dtype == FP8 and cfg.fp8_dot):
        compute = FP8
    else:
        compute = jnp.bfloat16 if jnp.dtype(x.dtype).itemsize <= 2 else jnp.float32
    if cfg.fast_accum and compute == FP8:
        fp8_fast_accum.install()  # before this call is lowered
    partial = cfg.split_k > 1
    merge = partial and cfg.merge
    epilogue_in_kernel = merge or not partial
    kernel = functools.partial(
        _kernel, M=M, Nw=Nw, K=K, F=F, cfg=cfg, gate_up=gate_up, stacked=stacked,
        has_ws=(w_scale is not None) and epilogue_in_kernel,
        has_xs=(x_scale is not None) and epilogue_in_kernel, partial=partial,
        compute_dtype=compute, interpret=interpret)
    args: list[jax.Array] = []
    if stacked:
        args.append(jnp.asarray(layer, jnp.int32).reshape(1))
    args += [x, w_nk]
    if w_scale is not None and epilogue_in_kernel:
        args.append(w_scale.astype(jnp.float32))
    if x_scale is not None and epilogue_in_kernel:
        args.append(x_scale.astype(jnp.float32))
    grid = (pl.cdiv(n_out, cfg.bn), pl.cdiv(M, cfg.bm), cfg.split_k)
    final = jax.ShapeDtypeStruct((M, n_out), out_dtype)
    partials = jax.ShapeDtypeStruct((cfg.split_k, M, Nw), jnp.float32)
    aliases = {}
    if merge:  # (out, partials scratch, counters: zeros in -> zeros out)
        args.append(jnp.zeros(grid[:2], jnp.int32))
        aliases = {len(args) - 1: 2}
        out_shape = (final, partials, jax.ShapeDtypeStruct(grid[:2], jnp.int32))
    else:
        out_shape = partials if partial else final
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    out = pl.pallas_call(
        kernel, out_shape=out_shape, grid=grid,
        in_specs=[any_spec] * len(args),
        out_specs=tuple(any_spec for _ in out_shape) if merge else any_spec,
        input_output_aliases=aliases,
        compiler_params=plt.CompilerParams(num_warps=cfg.num_warps,
                                           num_stages=cfg.num_stages),
        interpret=interpret, name="skinny_gemm")(*args)
    if merge:
        return out[0]
    if not partial:
        return out
    ws = w_scale
    if ws is not None and stacked:
        ws = ws[layer]
    if unreduced and not gate_up:
        return SplitKPartials(out, None if x_scale is None else x_scale.astype(jnp.float32),
                              None if ws is None else ws.astype(jnp.float32),
                              jnp.dtype(out_dtype))
    return xla_epilogue(out, ws, x_scale, gate_up, out_dtype)
