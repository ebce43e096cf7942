"""FP8 x FP8 dots on Hopper's wgmma from Pallas' Triton lowering ("fast accumulation").

Triton lowers an e4m3 x e4m3 -> f32 ``tt.dot`` to wgmma (MMAv3) only when the op allows
imprecise accumulation (``maxNumImpreciseAcc`` >= 32: Hopper's FP8 tensor cores keep a
reduced-precision accumulator); Pallas never sets it, so every FP8 dot of a Pallas-Triton
kernel ran as f16 mma.sync after widening both operands in registers (Triton 3.6, sm_90:
the W8A8 decode GEMM at 64 tokens, 524 SASS instructions a K step with 256 F2FP
conversions, against 145 with wgmma; NOTES_matmul "Session 13").

A kernel asks for it by passing ``precision=FAST_ACCUM`` (jax's own name for the same idea,
``DotAlgorithmPreset.ANY_F8_ANY_F8_F32_FAST_ACCUM``) to ``pl.dot``; :func:`install` wraps
the Pallas Triton ``dot_general`` rule so that such a dot lowers as the default one, then
sets ``maxNumImpreciseAcc = PROMOTE_EVERY`` on its ``tt.dot``: Triton adds the wgmma
accumulator into a separate float32 accumulator every PROMOTE_EVERY K elements — DeepSeek-V3's
recipe for FP8 GEMMs on H800s (arXiv 2412.19437, section 3.3.2: promotion every 128
elements bounds the accumulation error). Other dots lower unchanged. Interpret mode (CPU)
has no such algorithm: kernels pass ``precision=None`` there (exact float32 accumulation).
"""

from __future__ import annotations

from jax import lax

FAST_ACCUM = lax.DotAlgorithmPreset.ANY_F8_ANY_F8_F32_FAST_ACCUM
PROMOTE_EVERY = 128  # K elements per wgmma accumulation before the float32 add (DeepSeek-V3)


def install() -> None:
    """Wrap the Pallas Triton ``dot_general`` lowering rule (idempotent; process-wide).

    Raises nothing itself; the wrapped rule raises NotImplementedError at lowering time when
    a ``precision=FAST_ACCUM`` dot does not lower to one ``tt.dot`` (e.g. a cast after it)."""
    from jax._src.lib.mlir import ir
    from jax._src.pallas.triton import lowering

    orig = lowering.triton_lowering_rules[lax.dot_general_p]
    if getattr(orig, "_fp8_fast_accum", False):
        return

    def rule(ctx, a, b, *, precision, **params):
        if precision != FAST_ACCUM:
            return orig(ctx, a, b, precision=precision, **params)
        out = orig(ctx, a, b, precision=None, **params)
        op = out.owner
        if op.name != "tt.dot":  # f32 accumulator into f32 output: no cast after the dot
            raise NotImplementedError(f"FAST_ACCUM dot lowered to {op.name}, not tt.dot")
        op.attributes["maxNumImpreciseAcc"] = ir.IntegerAttr.get(
            ir.IntegerType.get_signless(32), PROMOTE_EVERY)
        return out

    rule._fp8_fast_accum = True
    lowering.triton_lowering_rules[lax.dot_general_p] = rule
