"""CPU lowering time of the 8B FP8 prefill program (T = 1024) for an H200, with the FP8 kernel
GEMMs under their own jit (``jit``, as the engine runs) or called inline per layer (``nojit``,
the state before 6a5bbb7): the Python lowering of the Mosaic GPU kernels per layer is what made
each FP8 prefill program take ~130 s to compile on the H200.

    PYTHONPATH=. python benchmarks/lower_prefill_cuda.py jit|nojit

Prints the lowering seconds, the count of ``mosaic_gpu`` in the module text and its length.
"""
import sys
import time

import jax

from jaxinfer.config import EngineConfig
from jaxinfer.compile import abstract_runner, model_config_of
from jaxinfer.batch import Bucket
from jax._src import mesh as mesh_lib
H200 = mesh_lib.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")
mc = model_config_of("dummy:llama-3.1-8b")
ec = EngineConfig(max_model_len=4352, max_num_seqs=256, max_num_batched_tokens=1024, max_prefill_seqs=64,
                  prefill_buckets=(1024,), decode_buckets=(256,), num_kv_pages=1000, quantization="fp8",
                  matmul_backend="pallas", dtype="bfloat16", attention_backend="reference")
import jaxinfer.models.transformer as T
_mo = T.model_options
T.model_options = lambda ec: {**_mo(ec), "interpret": False}
if sys.argv[1] == "nojit":
    from pallas_kernels.matmul.api import fp8_engine_linear
    T._fp8_kernel_linear = lambda h, w, s, interpret=False: fp8_engine_linear(h, w, s, interpret=interpret)
r = abstract_runner(mc, ec)
b = Bucket("prefill", 1024, 64, 272)
mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=H200)
t = time.time()
with jax.sharding.use_abstract_mesh(mesh):
    txt = r._jitted["sample"].trace(*r._abstract_args(b)).lower(lowering_platforms=("cuda",)).as_text()
print(sys.argv[1], "lower s", round(time.time() - t, 1), "mosaic", txt.count("mosaic_gpu"), "len", len(txt))
