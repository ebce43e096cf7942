"""Job plans of benchmarks/kernels/bench_matmul.py: which (shape, M, family, kind, backend,
tile config) jobs a run measures, in priority order (a run's deadline cuts the tail).

``plan`` is the broad sweep of sessions 1–2, ``plan_decode`` the session-4 W8A16 candidates
(swap-AB, Marlin-style dequantization) plus the Mosaic GPU prefill jobs, ``plan_w8a8`` the
session-4 W8A8 swap-AB decode candidates, ``plan_mdec`` the session-7 Mosaic GPU swap-AB
decode kernel (after its alignment fix) against the engine's decode paths, ``plan_mid`` the
session-9 candidates for 128 / 256 rows, ``plan_engine`` the session-11 engine path (GEMM
kernel alone), ``plan_fused`` the session-10 fusions of the Triton
decode GEMM, ``plan_tiles`` the session-13 tile sweep of the engine's decode GEMM. Results:
NOTES_matmul.md.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from pallas_kernels.matmul.fp8_plan import fp8_decode_config
from pallas_kernels.matmul.mgpu_gemm import (
    MgpuConfig,
    decode_config,
    mgpu_decode_supported,
    mgpu_supported,
    mid_split_k,
)
from pallas_kernels.matmul.triton_gemm import (
    TritonConfig,
    default_config,
    fit_smem,
    split_to_fill,
)

FP8 = jnp.float8_e4m3fn
SHAPES = {  # name: (K, N rows of the weight, fused gate+up)
    "8b_qkv": (4096, 6144, False), "8b_o": (4096, 4096, False),
    "8b_gate_up": (4096, 28672, True), "8b_down": (14336, 4096, False),
    "70b_up": (8192, 28672, False), "70b_o": (8192, 8192, False),
}
# Not in the default --shapes: the 8B gate+up weight as one plain [2F, K] GEMM, which is how
# the engine runs it above FP8_GATE_UP_EPILOGUE_MAX_M rows (SwiGLU in an XLA fusion after).
EXTRA_SHAPES = {"8b_gate_up_2f": (4096, 28672, False),
                # 70B projections the deep-K steps take besides up / o (plan_deep_k)
                "70b_down": (28672, 8192, False), "70b_qkv": (8192, 10240, False)}


def tri(bm, bn, bk, K, N_out, M, kind, gate_up, warps=4, stages=4, fp8_dot=False,
        swap_ab=False, fast_dequant=False, waves=2):
    """A TritonConfig with split-K chosen to fill ``waves`` waves of 132 SMs, fitted to smem."""
    wdt = jnp.bfloat16 if kind == "bf16" else FP8
    xdt = FP8 if kind == "w8a8" else jnp.bfloat16
    split = split_to_fill(-(-N_out // bn) * -(-M // bm), K, bk, target=132 * waves)
    c = TritonConfig(bm=bm, bn=bn, bk=bk, split_k=split, num_warps=warps, num_stages=stages,
                     fp8_dot=fp8_dot, swap_ab=swap_ab, fast_dequant=fast_dequant)
    return fit_smem(c, K, xdt, wdt, gate_up)


def plan_decode(ms, shapes):
    """Decode-shape W8A16 / bf16 candidates (session 4): swap-AB (weight as wgmma's register
    A operand) and Marlin-style FP8 dequantization, against XLA in the same run; then the
    Mosaic GPU prefill jobs of :func:`plan` (never run on a GPU before)."""
    first, grid, xla = [], [], []
    for sname in shapes:
        K, N, gu = SHAPES[sname]
        n_out = N // 2 if gu else N
        for M in ms:
            if M > 256:
                continue
            bm = max(16, 1 << (M - 1).bit_length())
            bm = min(bm, 64)
            for kind in ("bf16", "w8a16"):
                xla.append((sname, M, f"xla_{kind}", kind, "xla", None))
            def add(lst, fam, kind, **kw):
                lst.append((sname, M, fam, kind, "triton", tri(bm, K=K, N_out=n_out, M=M,
                                                               kind=kind, gate_up=gu, **kw)))
            add(first, "tri_w8a16_swap_fast", "w8a16", bn=64, bk=256, swap_ab=True,
                fast_dequant=True)
            add(first, "tri_w8a16_swap", "w8a16", bn=64, bk=256, swap_ab=True)
            add(first, "tri_w8a16_fast", "w8a16", bn=64, bk=256, fast_dequant=True)
            add(first, "tri_bf16_swap", "bf16", bn=64, bk=128, swap_ab=True)
            if M in (1, 16, 64):
                for bn, bk, st, wp in ((128, 256, 4, 4), (64, 512, 3, 4), (128, 128, 5, 4),
                                       (64, 256, 4, 8), (128, 256, 3, 8)):
                    add(grid, "tri_w8a16_swap_fast", "w8a16", bn=bn, bk=bk, stages=st,
                        warps=wp, swap_ab=True, fast_dequant=True)
                add(grid, "tri_w8a16_swap_fast", "w8a16", bn=64, bk=256, swap_ab=True,
                    fast_dequant=True, waves=4)
                add(grid, "tri_w8a16", "w8a16", bn=64, bk=256)
    prefill = [j for j in plan([m for m in ms if m >= 512], shapes) if j[4] != "xla"]
    return first + xla + grid + prefill


def plan_w8a8(ms, shapes):
    """Decode-shape W8A8 candidates (session 4): the Triton kernel with swap-AB and the FP8
    tensor-core dot at 16 tokens (x quantized per token in the same jit), against XLA W8A16 /
    bf16 (the engine's other paths) in the same run."""
    jobs, xla = [], []
    for sname in shapes:
        K, N, gu = SHAPES[sname]
        n_out = N // 2 if gu else N
        for M in ms:
            bm = min(64, max(16, 1 << (M - 1).bit_length()))
            for kind in ("bf16", "w8a16"):
                xla.append((sname, M, f"xla_{kind}", kind, "xla", None))
            for bn, bk, st, wp in ((64, 256, 4, 4), (128, 256, 4, 4), (64, 512, 3, 4),
                                   (128, 128, 5, 4), (128, 256, 3, 8)):
                if bm == 64 and bk == 512:
                    continue
                jobs.append((sname, M, "tri_w8a8_swap", "w8a8", "triton",
                             tri(bm, bn, bk, K, n_out, M, "w8a8", gu, warps=wp, stages=st,
                                 fp8_dot=True, swap_ab=True)))
    # mgpu_decode (Mosaic swap-AB) left out: its first GPU run (call 2, M = 1) faulted with a
    # misaligned address and poisoned the CUDA context for every later job.
    return jobs + xla


# Mosaic GPU swap-AB decode tiles: (family suffix, decode_config keywords). "" = 64 weight
# rows per CTA, "_t128" = 128 (twice the bytes per pipeline stage); split-K from
# mgpu_gemm.decode_split_k's byte model in both.
MDEC_VARIANTS = {"bf16": (("", {}),),
                 "w8a8": (("", {}), ("_t128", {"tile_m": 128}))}


def mdec_jobs(sname, M, shapes=None):
    """The ``mgpu_decode`` jobs of :func:`plan_mdec` for one shape and M."""
    K, N, _ = (shapes or SHAPES)[sname]
    out = []
    for kind, variants in MDEC_VARIANTS.items():
        dt = jnp.bfloat16 if kind == "bf16" else FP8
        for suffix, kw in variants:
            tm = kw.get("tile_m", 64)
            if N % tm:
                continue
            out.append((sname, M, f"mdec_{kind}{suffix}", kind, "mgpu_decode",
                        decode_config(M, K, N, dt, **kw)))
    return out


def plan_mdec(ms, shapes):
    """Session 7: the Mosaic GPU swap-AB decode kernel (bf16, W8A8 in two tilings) against
    the engine's paths at decode — the Triton W8A8 swap-AB kernel with the engine's own
    config (``fp8_plan.fp8_decode_config``), XLA bf16 and XLA W8A16 — M by M, so a deadline cuts
    the largest M last."""
    jobs = []
    for M in ms:
        for sname in shapes:
            K, N, gu = SHAPES[sname]
            jobs += mdec_jobs(sname, M) if M <= 128 else []  # the kernel's limit
            tc = fit_smem(fp8_decode_config(M, K, N // 2 if gu else N), K, FP8, FP8, gu)
            jobs.append((sname, M, "tri_w8a8_swap", "w8a8", "triton", tc))
            for kind in ("bf16", "w8a16"):
                jobs.append((sname, M, f"xla_{kind}", kind, "xla", None))
    return jobs


def plan_mid(ms, shapes):
    """Session 9: the engine's middle band (the 128 / 256-row decode buckets and the
    128-token prefill bucket), which runs FP8 weights as XLA W8A16 (no kernel was measured
    there): the Mosaic GPU kernels in both orientations — swap-AB (weights on wgmma's M side,
    every token on its N side, each weight byte read once; ``decode_config`` with 64- or
    128-row tiles) and the prefill tiling (128 tokens x 256 weight rows per CTA; walking N
    first or M first, the latter so both 128-token tiles of a weight tile share the L2) —
    W8A8 and bf16, against XLA bf16 / W8A16 / W8A8 in the same run. FP8 jobs first,
    largest M first (a deadline cuts bf16 Mosaic jobs first)."""
    fp8, bf16 = [], []
    for M in sorted(ms, reverse=True):
        for sname in shapes:
            K, N, _ = SHAPES[sname]
            for tm in (128, 64):
                if N % tm == 0 and mgpu_decode_supported(M, K, N, FP8):
                    fp8.append((sname, M, "mdec_w8a8" + ("_t128" if tm == 128 else ""),
                                "w8a8", "mgpu_decode", decode_config(M, K, N, FP8, tile_m=tm)))
            # split-K: a float32 epilogue; 3 stages so that it fits the shared memory
            sk = mid_split_k(M, K, N, 128)
            st = 4 if sk == 1 else 3
            fp8.append((sname, M, "mgpu_w8a8", "w8a8", "mgpu",
                        MgpuConfig(tile_k=128, split_k=sk, max_concurrent_steps=st)))
            fp8.append((sname, M, "mgpu_w8a8_mfirst", "w8a8", "mgpu",
                        MgpuConfig(tile_k=128, grid_minor_n=False, grid_tile_width=16,
                                   split_k=sk, max_concurrent_steps=st)))
            for kind in ("bf16", "w8a16", "w8a8"):
                fp8.append((sname, M, f"xla_{kind}", kind, "xla", None))
            if N % 128 == 0 and mgpu_decode_supported(M, K, N, jnp.bfloat16):
                bf16.append((sname, M, "mdec_bf16_t128", "bf16", "mgpu_decode",
                             decode_config(M, K, N, jnp.bfloat16, tile_m=128)))
            sk = mid_split_k(M, K, N, 64)
            bf16.append((sname, M, "mgpu_bf16", "bf16", "mgpu",
                         MgpuConfig(tile_k=64, split_k=sk, max_concurrent_steps=4 if sk == 1
                                    else 3)))
    return fp8 + bf16


def plan_fused(ms, shapes):
    """Session 10: the engine's Triton W8A8 decode GEMM (``fp8_plan.fp8_decode_config``) as it was
    (x quantized per token by two XLA kernels before it, split-K summed by an XLA fusion after
    it: ``fuse="none"``), with the split-K merge in the kernel (``"merge"``), and with x also
    quantized inside it per token and 128 columns (``"all"``, the new default), beside XLA
    bf16 and the Mosaic swap-AB kernel (``mdec_w8a8``, 128-row tiles where N allows) — M by
    M, so a deadline cuts the largest M last."""
    return _plan_triton_decode(ms, shapes, ("all", "merge", "none"))


def plan_engine(ms, shapes):
    """Session 12: the engine's decode path since session 11 — x normed and quantized per
    token by ``row_quant.norm_quant_fp8`` before the Triton W8A8 GEMM, so the GEMM kernel
    alone (``tri_w8a8_kernel``, its split-K epilogue fusion counted) is what a projection
    costs besides that one kernel; ``tri_w8a8_none`` with XLA's quantization in the call as
    before, XLA bf16 and the Mosaic swap-AB kernel beside them; the kernel alone with
    session 12's tiles (``_wave2``) and session 11's (``_k256``) where they differ."""
    jobs = []
    for job in _plan_triton_decode(ms, shapes, ("none",)):
        jobs.append(job)
        sname, M, family = job[:3]
        K, N, gu = SHAPES[sname]
        if family != "tri_w8a8_kernel":
            continue
        # A/B in the same run: session 13's tiles against session 12's ("wave2"), and
        # session 12's deep K steps against the 256 / 4-stage steps before them
        wave2 = fp8_decode_config(M, K, N // 2 if gu else N, gu, "none", tiles="wave2")
        k256 = fp8_decode_config(M, K, N // 2 if gu else N, gu, "none", deep_k=False,
                                 tiles="wave2")
        if wave2 != job[5]:
            jobs.append((sname, M, "tri_w8a8_kernel_wave2", "w8a8", "triton_k", wave2))
        if k256 not in (wave2, job[5]):
            jobs.append((sname, M, "tri_w8a8_kernel_k256", "w8a8", "triton_k", k256))
    return jobs


def _plan_triton_decode(ms, shapes, fuses):
    jobs = []
    for M in ms:
        for sname in shapes:
            K, N, gu = SHAPES[sname]
            n_out = N // 2 if gu else N
            for fuse in fuses:
                tc = fp8_decode_config(M, K, n_out, gu, fuse)
                jobs.append((sname, M, f"tri_w8a8_{fuse}", "w8a8", "triton", tc))
            # the engine's kernel without the XLA quantization before it (its epilogue
            # fusion, when split, still counts): what the GEMM kernel itself streams
            jobs.append((sname, M, "tri_w8a8_kernel", "w8a8", "triton_k",
                         fp8_decode_config(M, K, n_out, gu, "none")))
            jobs.append((sname, M, "xla_bf16", "bf16", "xla", None))
            tm = 128 if N % 128 == 0 else 64
            if M <= 128 and mgpu_decode_supported(M, K, N, FP8):
                jobs.append((sname, M, "mdec_w8a8", "w8a8", "mgpu_decode",
                             decode_config(M, K, N, FP8, tile_m=tm)))
    return jobs


# Session 13's sweep around the engine's Triton W8A8 decode tiles, (bn, bk, stages, warps,
# waves of 132 SMs that split-K aims for). At <= 16 tokens: deeper K steps with fewer stages
# (gate_up's two weight tiles do not fit 3 x 512 in the shared-memory budget), 32-row tiles,
# fewer / more splits (the 4096-wide shapes pay an XLA epilogue fusion per split-K call).
# At 32 / 64 tokens: 128-row weight tiles (each x tile serves twice the weight rows; at 64
# rows x re-read by every 64-row tile is as many bytes, from the L2, as the weight itself).
TILES_SMALL_M = ((64, 512, 3, 4, 2), (64, 512, 2, 4, 2), (32, 512, 3, 4, 2),
                 (32, 512, 3, 4, 1), (32, 256, 4, 4, 2), (32, 256, 4, 4, 1),
                 (64, 256, 4, 4, 1), (64, 256, 4, 4, 4), (64, 1024, 2, 4, 2),
                 (64, 128, 6, 4, 2), (128, 256, 3, 8, 2))
TILES_WIDE_M = ((128, 256, 3, 8, 2), (128, 256, 4, 4, 2), (128, 128, 4, 4, 2),
                (128, 256, 3, 4, 1), (64, 128, 5, 4, 2), (64, 256, 3, 4, 2),
                (64, 256, 4, 4, 1), (64, 256, 4, 4, 4))


# Session 31: at 32-64 tokens the large weights stream at 2.3-2.8 TB/s (issue #4 asks 3.6).
# 256-row weight tiles (8 warps: two warpgroups of 128 rows) halve x's L2 re-reads again
# against 128, and one wave (waves=1) keeps split-K's float32 partials small.
TILES_BN256 = ((256, 128, 3, 8, 1), (256, 128, 4, 8, 1), (256, 128, 3, 8, 2),
               (256, 64, 4, 8, 1), (256, 64, 6, 8, 1), (256, 256, 2, 8, 1),
               (128, 128, 6, 8, 1), (128, 128, 4, 8, 1))


def plan_wide(ms, shapes):
    """Session 31: :func:`plan_tiles` at 32+ tokens with :data:`TILES_WIDE_M` and the
    256-row weight tiles of :data:`TILES_BN256` (the engine's tiles and XLA bf16 beside)."""
    jobs = plan_tiles([m for m in ms if m >= 32], shapes, wide=TILES_WIDE_M + TILES_BN256)
    # each swept tile also with its FP8 dot on wgmma (fast_accum, as the engine's own tile
    # runs since session 13): family tri_w8a8_sweep_fa
    fa = []
    for sname, M, fam, kind, backend, c in jobs:
        if fam == "tri_w8a8_sweep" and not c.fast_accum:
            K, _, gu = {**SHAPES, **EXTRA_SHAPES}[sname]
            c = fit_smem(dataclasses.replace(c, fast_accum=True), K, FP8, FP8, gu)
            fa.append((sname, M, "tri_w8a8_sweep_fa", kind, backend, c))
    return jobs + fa


def plan_m64(ms, shapes):
    """Session 31: 32-64 tokens, where the swap-AB GEMMs (weights on wgmma's M side, the
    tokens as N = 32-64) give ~365 TFLOP/s on both Hopper cards, which on an H200 holds
    the large weights to ~2.8 TB/s. Candidates beside the engine's Triton tile: the H100
    sweep's best Triton tile (64-row weight tiles, 256-deep K, 3 stages, FP8 dot on wgmma:
    ``tri_w8a8_fa64``), the Mosaic swap-AB kernel (64 / 128-row weight tiles), and the
    Mosaic kernel in the plain orientation with one 64-token row tile (``mgpu_w8a8_m64_*``:
    x as wgmma's A operand, 128 or 256 weight rows a warpgroup as N, so each instruction
    does 2-4x the work of the swap-AB one for the same operand bytes); XLA bf16 beside."""
    jobs = []
    for M in ms:
        bm = min(64, max(16, 1 << max(M - 1, 0).bit_length()))
        for sname in shapes:
            if sname == "8b_gate_up":
                sname = "8b_gate_up_2f"
            K, N, gu = {**SHAPES, **EXTRA_SHAPES}[sname]
            jobs.append((sname, M, "tri_w8a8_kernel", "w8a8", "triton_k",
                         fp8_decode_config(M, K, N, gu, "none")))
            c = tri(bm, 64, 256, K, N, M, "w8a8", gu, warps=4, stages=3, fp8_dot=True,
                    swap_ab=True, waves=1)
            jobs.append((sname, M, "tri_w8a8_fa64", "w8a8", "triton_k",
                         fit_smem(dataclasses.replace(c, fast_accum=True), K, FP8, FP8, gu)))
            for tm in (128, 64):
                if N % tm == 0 and mgpu_decode_supported(M, K, N, FP8):
                    jobs.append((sname, M, f"mdec_w8a8_t{tm}", "w8a8", "mgpu_decode",
                                 decode_config(M, K, N, FP8, tile_m=tm)))
            for tn, tk, st in ((128, 128, 4), (128, 128, 6), (256, 64, 4), (256, 128, 2)):
                if N % (2 * tn):
                    continue
                sk = mid_split_k(M, K, N, tk, tile_m=64, tile_n=2 * tn)
                jobs.append((sname, M, f"mgpu_w8a8_m64_n{tn}k{tk}s{st}", "w8a8", "mgpu",
                             MgpuConfig(tile_m=64, tile_n=tn, tile_k=tk, split_k=sk,
                                        max_concurrent_steps=st if sk == 1 else min(st, 3))))
            jobs.append((sname, M, "xla_bf16", "bf16", "xla", None))
    return jobs[:1] and [jobs[0][:2] + ("warmup",) + jobs[0][3:]] + jobs


def plan_m512(ms, shapes):
    """Session 32: the prefill tiling at decode buckets of 512-1,024 rows (the 1000 / 1000 x
    512 offline run decodes 512 rows a step; an H100 profile of that step put the Mosaic
    GEMMs at ~1,040 TFLOP/s). The engine's tile (``default_config``: 128 x 256 CTA tiles)
    gives 4 x N / 256 CTAs at 512 rows -- 64 for the 4096-wide o and down, 96 for qkv: half
    to three quarters of 132 SMs. Beside it: 128 x 128 CTA tiles (``tile_n`` 64; 4 or 6
    stages), 64 x 256 (``tile_m`` 64), and XLA's FP8 and bf16 dots. Gate+up as the engine
    runs it above 16 rows: one plain [2F, K] GEMM."""
    jobs = []
    for M in ms:
        for sname in shapes:
            if sname == "8b_gate_up":
                sname = "8b_gate_up_2f"
            K, N, _ = {**SHAPES, **EXTRA_SHAPES}[sname]
            for fam, c in (("mgpu_w8a8", MgpuConfig()),
                           ("mgpu_w8a8_n64", MgpuConfig(tile_n=64)),
                           ("mgpu_w8a8_n64s6", MgpuConfig(tile_n=64, max_concurrent_steps=6)),
                           ("mgpu_w8a8_m64", MgpuConfig(tile_m=64))):
                if mgpu_supported(M, K, N, FP8, c):
                    jobs.append((sname, M, fam, "w8a8", "mgpu", c))
            jobs.append((sname, M, "xla_w8a8", "w8a8", "xla", None))
            jobs.append((sname, M, "xla_bf16", "bf16", "xla", None))
    return jobs[:1] and [jobs[0][:2] + ("warmup",) + jobs[0][3:]] + jobs


def plan_tiles(ms, shapes, wide=TILES_WIDE_M):
    """Session 13: the engine's Triton W8A8 decode GEMM, kernel alone (x quantized outside
    the timed call, as the engine's norm_quant path gives it), with the engine's own tiles
    (``tri_w8a8_kernel``, ``fp8_plan.fp8_decode_config``) and the best of a sweep around them
    (``tri_w8a8_sweep``: :data:`TILES_SMALL_M` at <= 16 tokens, :data:`TILES_WIDE_M` above),
    XLA bf16 beside them. Gate+up runs as the engine does: with SwiGLU in the epilogue at
    <= 16 tokens, as the plain ``8b_gate_up_2f`` GEMM above. M by M, so a deadline cuts the
    largest M last."""
    from pallas_kernels.matmul.fp8_plan import FP8_GATE_UP_EPILOGUE_MAX_M
    jobs = []
    for M in ms:
        bm = min(64, max(16, 1 << max(M - 1, 0).bit_length()))
        for sname in shapes:
            if sname == "8b_gate_up" and M > FP8_GATE_UP_EPILOGUE_MAX_M:
                sname = "8b_gate_up_2f"
            K, N, gu = {**SHAPES, **EXTRA_SHAPES}[sname]
            n_out = N // 2 if gu else N
            eng = fp8_decode_config(M, K, n_out, gu, "none")
            jobs.append((sname, M, "tri_w8a8_kernel", "w8a8", "triton_k", eng))
            jobs.append((sname, M, "xla_bf16", "bf16", "xla", None))
            seen = {eng}
            for bn, bk, st, wp, waves in TILES_SMALL_M if bm == 16 else wide:
                c = tri(bm, bn, bk, K, n_out, M, "w8a8", gu, warps=wp, stages=st,
                        fp8_dot=True, swap_ab=True, waves=waves)
                if c not in seen:
                    seen.add(c)
                    jobs.append((sname, M, "tri_w8a8_sweep", "w8a8", "triton_k", c))
    # the first timed jobs of a process have shown 7-46 ms outliers (sessions 12's calls 2
    # and 4): the first job once more, as "warmup", before the rest
    return jobs[:1] and [jobs[0][:2] + ("warmup",) + jobs[0][3:]] + jobs


def plan_fast_accum(ms, shapes):
    """Session 13: the engine's Triton W8A8 decode GEMM (kernel alone, as ``plan_tiles``)
    with its FP8 dot on wgmma (``TritonConfig.fast_accum``, fp8_fast_accum.py: Triton's
    MMAv3 keeps every stage's tiles in shared memory, so one stage fewer holds the same
    programs an SM) against the engine's tiles (f16 mma.sync after widening), in the same
    run, M by M."""

    from pallas_kernels.matmul.fp8_plan import FP8_GATE_UP_EPILOGUE_MAX_M
    jobs = []
    for M in ms:
        for sname in shapes:
            if sname == "8b_gate_up" and M > FP8_GATE_UP_EPILOGUE_MAX_M:
                sname = "8b_gate_up_2f"
            K, N, gu = {**SHAPES, **EXTRA_SHAPES}[sname]
            eng = fp8_decode_config(M, K, N // 2 if gu else N, gu, "none")
            jobs.append((sname, M, "tri_w8a8_kernel", "w8a8", "triton_k", eng))
            for st in sorted({max(2, eng.num_stages - 1), eng.num_stages}):
                c = dataclasses.replace(eng, fast_accum=True, num_stages=st)
                jobs.append((sname, M, "tri_w8a8_fastacc", "w8a8", "triton_k", c))
    return jobs


def plan_deep_k(ms, shapes):
    """Session 14: session 12's deep K steps (512 K a step, mma.sync) against the 256-deep
    steps the engine takes with them off — which since session 13 run the FP8 dot on wgmma
    (fast accum) — kernel alone, in the same run; only shapes / M where the two differ."""
    jobs = []
    for M in ms:
        for sname in shapes:
            K, N, gu = {**SHAPES, **EXTRA_SHAPES}[sname]
            n_out = N // 2 if gu else N
            on = fp8_decode_config(M, K, n_out, gu, "none", deep_k=True)
            off = fp8_decode_config(M, K, n_out, gu, "none", deep_k=False)
            if on != off:
                jobs.append((sname, M, "tri_w8a8_deepk_on", "w8a8", "triton_k", on))
                jobs.append((sname, M, "tri_w8a8_deepk_off", "w8a8", "triton_k", off))
    return jobs


def plan(ms, shapes, smoke=False, safe=False):
    """(shape, M, family, kind, backend, cfg) jobs in priority order (the deadline cuts the tail).

    Run 1 (2026-11-29) measured XLA and the default Triton tiles at M = 1, 8, 64; this plan
    puts prefill (Mosaic GPU, never run before), then new decode candidates first.
    """
    P = {i: [] for i in range(6)}
    for sname in shapes:
        K, N, gu = SHAPES[sname]
        n_out = N // 2 if gu else N
        for M in ms:
            bm = 16 if M <= 16 else (32 if M <= 32 else 64)
            if M >= 512:
                for kind in ("bf16", "w8a8"):
                    P[0].append((sname, M, f"xla_{kind}", kind, "xla", None))
                    if safe:
                        continue
                    cfgs = mgpu_cfgs(kind)
                    P[0].append((sname, M, f"mgpu_{kind}", kind, "mgpu", cfgs[0]))
                    if M == min(m for m in ms if m >= 512) and sname in ("8b_gate_up", "70b_up"):
                        P[1] += [(sname, M, f"mgpu_{kind}", kind, "mgpu", c) for c in cfgs[1:]]
                continue
            if M in (1, 32, 64):
                if not safe:
                    for kind in ("bf16", "w8a8"):
                        P[1].append((sname, M, f"mdec_{kind}", kind, "mgpu_decode", None))
                    P[1].append((sname, M, "tri_w8a8", "w8a8", "triton",
                                 tri(64, 64, 256, K, n_out, M, "w8a8", gu, fp8_dot=True)))
                    if M == 64:
                        P[1].append((sname, M, "tri_w8a8", "w8a8", "triton",
                                     tri(64, 128, 128, K, n_out, M, "w8a8", gu, fp8_dot=True)))
                P[1].append((sname, M, "tri_w8a16", "w8a16", "triton",
                             tri(bm, 64, 256, K, n_out, M, "w8a16", gu)))
                if M == 1:
                    P[1].append((sname, M, "tri_bf16", "bf16", "triton",
                                 tri(bm, 64, 128, K, n_out, M, "bf16", gu)))
            if M in (128, 256):
                for kind in ("bf16", "w8a16", "w8a8"):
                    wdt = jnp.bfloat16 if kind == "bf16" else FP8
                    xdt = FP8 if kind == "w8a8" else jnp.bfloat16
                    c = default_config(M, K, n_out, wdt, xdt, gu)
                    if safe and c.fp8_dot:
                        continue
                    P[2].append((sname, M, f"tri_{kind}", kind, "triton", c))
                if not safe:
                    for kind in ("bf16", "w8a8"):
                        if M == 128:
                            P[2].append((sname, M, f"mdec_{kind}", kind, "mgpu_decode", None))
                        P[2].append((sname, M, f"mgpu_{kind}", kind, "mgpu", mgpu_cfgs(kind)[0]))
                for kind in ("bf16", "w8a16", "w8a8"):
                    P[3].append((sname, M, f"xla_{kind}", kind, "xla", None))
            if M in (8,) and not safe:
                for kind in ("bf16", "w8a8"):
                    P[4].append((sname, M, f"mdec_{kind}", kind, "mgpu_decode", None))
            if M in (1, 8, 32, 64):
                for kind in ("bf16", "w8a16", "w8a8"):
                    P[5 if M != 32 else 3].append((sname, M, f"xla_{kind}", kind, "xla", None))
    return [j for i in sorted(P) for j in P[i]]


def mgpu_cfgs(kind):
    tk = 64 if kind == "bf16" else 128
    return [MgpuConfig(tile_k=tk),
            MgpuConfig(tile_k=tk, grid_minor_n=False, grid_tile_width=16),
            MgpuConfig(tile_k=tk, tile_n=64, max_concurrent_steps=6 if tk == 128 else 5)]
