"""Lower kernels for an H200 on a machine without a GPU (CI): trace under an abstract mesh of
one "NVIDIA H200" and lower for the "cuda" platform, so Pallas/Triton lowering errors show in
CPU tests."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import jax
import jax.numpy as jnp
from jax._src import mesh as mesh_lib

H200 = mesh_lib.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")


@contextlib.contextmanager
def triton_ir() -> Iterator[list[str]]:
    """Collect the Triton IR (text) of every Pallas-Triton kernel lowered inside the block,
    in order (the IR Pallas hands to XLA; benchmarks/kernels/triton_static.py compiles it)."""
    from jax._src.pallas.triton import lowering

    seen: list[str] = []
    orig = lowering.lower_jaxpr_to_triton_module

    def hook(*a, **k):
        r = orig(*a, **k)
        seen.append(r.module.operation.get_asm(enable_debug_info=False))
        return r

    lowering.lower_jaxpr_to_triton_module = hook
    try:
        yield seen
    finally:
        lowering.lower_jaxpr_to_triton_module = orig


def lower_for_cuda(fn, *avals) -> str:
    """StableHLO text of ``jax.jit(fn)`` lowered for CUDA at the abstract values ``avals``."""
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=H200)
    with jax.sharding.use_abstract_mesh(mesh):
        return jax.jit(fn).trace(*avals).lower(lowering_platforms=("cuda",)).as_text()


def decode_avals(B: int, maxp: int, kv_dtype, *, Hq: int = 32, Hkv: int = 8, D: int = 128,
                 ps: int = 16, L: int = 2) -> list[jax.ShapeDtypeStruct]:
    """Abstract operands of ``paged_decode_attention`` (q bf16 [B, Hq, D], stacked K / V
    caches [L, Hkv, B * maxp + 1, ps, D] of ``kv_dtype``, layer, block tables [B, maxp],
    lengths [B]); Llama-3.1-8B heads by default."""
    sds, P = jax.ShapeDtypeStruct, B * maxp + 1
    return [sds((B, Hq, D), jnp.bfloat16), sds((L, Hkv, P, ps, D), kv_dtype),
            sds((L, Hkv, P, ps, D), kv_dtype), sds((), jnp.int32), sds((B, maxp), jnp.int32),
            sds((B,), jnp.int32)]


def lower_paged_kernel(kernel, avals: list, kv_dtype, window, **kw) -> str:
    """Lower a paged-attention kernel (``kernel(*avals, scale=, window=, [k_scale, v_scale,]
    **kw)``) for CUDA; ``window="traced"`` passes the window as a traced int32 scalar, FP8 KV
    gets k/v scales 0.5 / 2.0."""
    scales = {"k_scale": 0.5, "v_scale": 2.0} if kv_dtype == jnp.float8_e4m3fn else {}
    n = len(avals)
    if window == "traced":
        def fn(*a):
            return kernel(*a[:n], scale=0.1, window=a[n], **scales, **kw)
        avals = [*avals, jax.ShapeDtypeStruct((), jnp.int32)]
    else:
        fn = functools.partial(kernel, scale=0.1, window=window, **scales, **kw)
    return lower_for_cuda(fn, *avals)
