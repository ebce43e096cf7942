"""CPU lowering time of the 8B prefill program (T = 1024 unless --tokens) for an H200.

GEMMs: with the FP8 kernel GEMMs under their own jit (``jit``, as the engine runs) or called
inline per layer (``nojit``, the state before 6a5bbb7): the Python lowering of the Mosaic GPU
kernels per layer is what made each FP8 prefill program take ~130 s to compile on the H200.

Attention (``--attention``): ``reference`` (jnp, the default, as before), ``pallas`` (Triton
prefill) or ``pallas_mgpu`` (Mosaic GPU varlen prefill for buckets of T >= MGPU_MIN_TOKENS);
``--attention-nojit`` calls the prefill kernels inline per layer (the state before their
module-level jit: one Mosaic/Triton lowering per layer). ``--quantization none`` for bf16.

    PYTHONPATH=. python benchmarks/lower_prefill_cuda.py jit|nojit
    PYTHONPATH=. python benchmarks/lower_prefill_cuda.py jit --quantization none \
        --attention pallas_mgpu [--attention-nojit] [--tokens 4096]

Prints the lowering seconds, the count of ``mosaic_gpu`` and of ``__gpu$xla.gpu.triton`` in
the module text and its length.

Measured (2-core CPU, bf16 8B, ``jit --quantization none``), before (95e519b) -> after the
prefill kernels' module-level jit: pallas_mgpu T=1024 62.2 s (mosaic 672, triton 32, 17.8 MB)
-> 2.1 s (21, 1, 1.3 MB); T=4096 49.5 s -> 2.7 s; pallas (Triton) T=1024 7.8 s -> 1.2 s
(triton 32 -> 1). ``--attention-nojit`` (after) 51.4 s at T=1024.
"""
import argparse
import time

import jax
from jax._src import mesh as mesh_lib

from jaxinfer.batch import Bucket
from jaxinfer.compile import abstract_runner, model_config_of
from jaxinfer.config import EngineConfig

p = argparse.ArgumentParser()
p.add_argument("gemm", choices=["jit", "nojit"], nargs="?", default="jit")
p.add_argument("--attention", default="reference",
               choices=["reference", "pallas", "pallas_mgpu"])
p.add_argument("--attention-nojit", action="store_true")
p.add_argument("--quantization", default="fp8", choices=["fp8", "none"])
p.add_argument("--tokens", type=int, default=1024)
a = p.parse_args()

H200 = mesh_lib.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")
mc = model_config_of("dummy:llama-3.1-8b")
quant = None if a.quantization == "none" else a.quantization
ec = EngineConfig(max_model_len=4352, max_num_seqs=256, max_num_batched_tokens=a.tokens,
                  max_prefill_seqs=64, prefill_buckets=(a.tokens,), decode_buckets=(256,),
                  num_kv_pages=1000, quantization=quant, matmul_backend="pallas",
                  dtype="bfloat16", attention_backend=a.attention)
import jaxinfer.layers.attention as A  # noqa: E402
import jaxinfer.models.transformer as T  # noqa: E402

_mo = T.model_options
T.model_options = lambda ec: {**_mo(ec), "interpret": False}
if a.gemm == "nojit":
    import jaxinfer.models.projection as Proj
    from pallas_kernels.matmul.fp8_plan import fp8_engine_linear

    def _nojit(h, w, s, env=(), **kw):  # the FP8 GEMM inlined, without its module-level jit
        return fp8_engine_linear(h, w, s, **kw)

    T._fp8_kernel_linear = Proj.fp8_kernel_linear = _nojit
if a.attention != "reference":  # off a GPU get_backend would pick interpret mode
    from jaxinfer.layers.pallas_attention import PallasAttentionBackend
    A.get_backend = lambda name: PallasAttentionBackend(
        interpret=False, prefill_mgpu=name == "pallas_mgpu", kernel_jit=not a.attention_nojit)
r = abstract_runner(mc, ec)
b = Bucket("prefill", a.tokens, 64, 272)
mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=H200)
t = time.time()
with jax.sharding.use_abstract_mesh(mesh):
    txt = r._jitted["sample"].trace(*r.abstract_args(b)).lower(
        lowering_platforms=("cuda",)).as_text()
print(a.gemm, a.quantization, a.attention, "attn-nojit" if a.attention_nojit else "attn-jit",
      f"T={a.tokens}", "lower s", round(time.time() - t, 1), "mosaic", txt.count("mosaic_gpu"),
      "triton", txt.count("__gpu$xla.gpu.triton"), "len", len(txt))
