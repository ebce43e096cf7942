"""The engine's FP8 projections on the Pallas GEMMs (matmul_backend="pallas", interpret mode
on CPU): the measured policy per row count, and the model wiring (kernel layout, scales)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams
from jaxinfer.config import ConfigError, EngineConfig
from pallas_kernels.matmul import api, fp8_plan, linear_ref, quantize_rows_fp8
from tests.conftest import tiny_loaded
from tests.kernels.cuda_lowering import lower_for_cuda

F32 = jnp.float32


def test_fp8_engine_linear_names_a_wrong_rank():
    wq, ws = quantize_rows_fp8(jnp.ones((512, 256), F32))
    with pytest.raises(api.LinearError, match=r"x must be \[M, K\] and the weight \[N, K\], "
                                              r"got \(2, 3, 256\) and \(512, 256\)"):
        fp8_plan.fp8_engine_linear(jnp.ones((2, 3, 256), jnp.bfloat16), wq, ws, interpret=True)


@pytest.mark.parametrize("M,want", [(1, ("triton", True)), (37, ("triton", True)),
                                    (128, ("mgpu_decode", True)), (200, ("mgpu", True)),
                                    (512, ("mgpu", True))])
def test_fp8_engine_linear_follows_the_plan(M, want):
    K, N = 256, 512
    x = jax.random.normal(jax.random.key(M), (M, K), F32).astype(jnp.bfloat16)
    w = jax.random.normal(jax.random.key(M + 1), (N, K), F32) / 16
    wq, ws = quantize_rows_fp8(w)
    assert fp8_plan.fp8_engine_plan(M, K, N) == want
    backend, act_quant = want
    out = fp8_plan.fp8_engine_linear(x, wq, ws, interpret=True)
    if act_quant:
        xq, xs = quantize_rows_fp8(x)
        ref = linear_ref(xq, wq, ws, xs, out_dtype=F32)
    else:
        ref = linear_ref(x, wq, ws, out_dtype=F32)
    out = np.asarray(out, np.float64)
    assert out.shape == (M, N) and np.isfinite(out).all()
    ref = np.asarray(ref, np.float64)
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 1e-2  # bf16 output rounding
    # which kernel the H200 program holds (lowered for CUDA on this CPU)
    text = lower_for_cuda(fp8_plan.fp8_engine_linear, *(jax.ShapeDtypeStruct(a.shape, a.dtype)
                                                   for a in (x, wq, ws)))
    assert ("skinny_gemm" in text) == (backend == "triton")
    assert ("mosaic_gpu" in text) == (backend in ("mgpu", "mgpu_decode"))


@pytest.mark.parametrize("M,K,N,want", [
    (128, 4096, 6144, "mgpu_decode"), (256, 4096, 4096, "mgpu_decode"),
    (256, 14336, 4096, "mgpu_decode"), (256, 4096, 28672, "mgpu"), (256, 8192, 28672, "mgpu"),
    (192, 4096, 6144, "mgpu"), (96, 14336, 4096, "mgpu_decode"), (255, 4096, 6144, "mgpu_decode")])
def test_middle_band_plan_at_llama_shapes_lowers_for_cuda(M, K, N, want, monkeypatch):
    """128 / 256 rows (the engine's largest decode buckets): W8A8 on the Mosaic GPU kernels
    at the Llama-3.1 projection shapes, in the tilings measured best (swap-AB, or the prefill
    tiling for the wide projections above 128 rows), each fitting an H200 when lowered;
    $JAXINFER_FP8_MID_GEMM=xla gives XLA W8A16 back."""
    assert fp8_plan.fp8_engine_plan(M, K, N) == (want, True)
    sds = jax.ShapeDtypeStruct
    avals = (sds((M, K), jnp.bfloat16), sds((N, K), jnp.float8_e4m3fn), sds((N,), F32))
    assert "mosaic_gpu" in lower_for_cuda(fp8_plan.fp8_engine_linear, *avals)
    monkeypatch.setenv("JAXINFER_FP8_MID_GEMM", "xla")
    assert fp8_plan.fp8_engine_plan(M, K, N) == ("xla", False)
    monkeypatch.setenv("JAXINFER_FP8_MID_GEMM", "cublas")
    with pytest.raises(api.LinearError, match="JAXINFER_FP8_MID_GEMM"):
        fp8_plan.fp8_engine_plan(M, K, N)


@pytest.mark.parametrize("M,want", [(16, "triton"), (37, "mgpu_decode"), (64, "mgpu_decode"),
                                    (65, "mgpu_decode")])
def test_opt_in_mosaic_decode_gemm(M, want, monkeypatch):
    """$JAXINFER_FP8_DECODE_GEMM=mgpu: rows 17..64 on the Mosaic GPU swap-AB decode kernel
    (interpreted here, against the W8A8 reference), lowered as a Mosaic GPU kernel; 65 rows
    are the middle band, on that kernel by default whatever the variable says."""
    monkeypatch.setenv("JAXINFER_FP8_DECODE_GEMM", "mgpu")
    jax.clear_caches()  # the choice is made at trace time: no trace of the default plan reused
    K, N = 256, 512
    assert fp8_plan.fp8_engine_plan(M, K, N)[0] == want
    if want != "mgpu_decode":
        return
    x = jax.random.normal(jax.random.key(M), (M, K), F32).astype(jnp.bfloat16)
    wq, ws = quantize_rows_fp8(jax.random.normal(jax.random.key(M + 1), (N, K), F32) / 16)
    out = np.asarray(fp8_plan.fp8_engine_linear(x, wq, ws, interpret=True), np.float64)
    xq, xs = quantize_rows_fp8(x)
    ref = np.asarray(linear_ref(xq, wq, ws, xs, out_dtype=F32), np.float64)
    assert out.shape == (M, N) and np.isfinite(out).all()
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 1e-2
    text = lower_for_cuda(fp8_plan.fp8_engine_linear, *(jax.ShapeDtypeStruct(a.shape, a.dtype)
                                                   for a in (x, wq, ws)))
    assert "mosaic_gpu" in text and "skinny_gemm" not in text
    monkeypatch.setenv("JAXINFER_FP8_DECODE_GEMM", "cutlass")
    with pytest.raises(api.LinearError, match="JAXINFER_FP8_DECODE_GEMM"):
        fp8_plan.fp8_engine_plan(M, K, N)  # checked at every row count


def test_matmul_backend_is_validated():
    with pytest.raises(ConfigError, match="matmul_backend"):
        EngineConfig(matmul_backend="cutlass")


def _llm(mm: str, model=None, **extra) -> LLM:
    kw = dict(max_model_len=64, block_size=16, max_num_seqs=4, max_num_batched_tokens=128,
              decode_buckets=(4,), prefill_buckets=(128,), page_buckets=(4,))
    return LLM(model or tiny_loaded("llama", head_dim=16), quantization="fp8",
               matmul_backend=mm, **{**kw, **extra})


# A 32-token prefill bucket for the hidden-512 engines whose subject is decode: at 128 tokens
# their prefill GEMMs take the Mosaic GPU decode kernel (fp8_engine_plan), whose interpreter
# ran ~15 s a prefill step on the CPU. test_rope_kv_write_takes_the_qkv_gemms_split_k_partials
# keeps the 128-token bucket: the engine-level run of that kernel in a prefill program.
_DECODE_ONLY = dict(max_num_batched_tokens=32, prefill_buckets=(32,))


def _weight(llm: LLM, name: str) -> jax.Array:
    """The runner's weight array whose path contains ``name`` (not its scale)."""
    flat = {"/".join(map(str, k)): v for k, v in
            jax.tree_util.tree_leaves_with_path(llm.engine.runner.state)}
    found = [v for k, v in flat.items() if name in k and "scale" not in k]
    assert found, name
    return found[0]


def _assert_same_outputs(got, ref, atol: float) -> None:
    """Same greedy tokens per request, and their logprobs within ``atol``."""
    for g, r in zip(got, ref):
        assert g.outputs[0].token_ids == r.outputs[0].token_ids
        lp_g = [d[t] for d, t in zip(g.outputs[0].logprobs, g.outputs[0].token_ids)]
        lp_r = [d[t] for d, t in zip(r.outputs[0].logprobs, r.outputs[0].token_ids)]
        np.testing.assert_allclose(lp_g, lp_r, atol=atol)


def _cuda_program_text(monkeypatch, cfg, bucket, **engine_args) -> str:
    """StableHLO of the FP8 kernel engine's sample program for ``bucket``, lowered for an
    H200 from abstract weights (kernels not in interpret mode)."""
    import jaxinfer.models.transformer as T
    from jaxinfer.compile import abstract_runner

    options = T.model_options
    monkeypatch.setattr(T, "model_options", lambda ec: {**options(ec), "interpret": False})
    ec = EngineConfig(**{**dict(max_model_len=64, block_size=16, max_num_seqs=4,
                                num_kv_pages=8, decode_buckets=(4,), max_prefill_seqs=1,
                                quantization="fp8", matmul_backend="pallas",
                                attention_backend="reference", dtype="bfloat16"),
                         **engine_args})
    runner = abstract_runner(cfg, ec)
    args = runner.abstract_args(bucket)
    return lower_for_cuda(lambda *a: runner._jitted["sample"](*a), *args)


@pytest.mark.parametrize("scan", [False, True])
def test_fused_norm_quant_engine_equals_the_unfused_one(scan, monkeypatch, request):
    """hidden 64 (row_quant takes it): the QKV / gate-up inputs are RMS-normalized and
    quantized by norm_quant_fp8, the o / down inputs quantized by it; a float32 engine gives
    the same tokens and logprobs as the same engine with XLA's norm, absmax and convert
    (fp8_takes_quantized_x forced False), unrolled and scanned."""
    model = tiny_loaded("llama", hidden_size=64, head_dim=16)
    prompts = [[5, 6, 7], list(range(10, 27))]
    sp = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=1)
    assert fp8_plan.fp8_takes_quantized_x(4, 64, 64) and fp8_plan.fp8_takes_quantized_x(
        4, 64, 2 * model.config.intermediate_size, True)
    got = _llm("pallas", model, scan_layers=scan, dtype="float32").generate(prompts, sp)
    monkeypatch.setattr(fp8_plan, "fp8_takes_quantized_x", lambda *a, **k: False)
    jax.clear_caches()  # the kernel GEMM's module-level jit keeps traces across the patch
    request.addfinalizer(jax.clear_caches)
    ref = _llm("pallas", model, scan_layers=scan, dtype="float32").generate(prompts, sp)
    _assert_same_outputs(got, ref, atol=1e-5)


def test_scanned_layers_run_the_fp8_kernels_in_their_layout():
    """scan_layers=True with the FP8 kernels: the stacked [L, K, N] weights go to the
    kernels' [L, N, K] layout (a layer's slice inside the scan is the kernels' [N, K]; before
    the fix the scan body handed the GEMM a [K, N] weight and lowering failed), and the
    scanned engine's tokens and logprobs are the unrolled engine's."""
    prompts = [[5, 6, 7], list(range(10, 27))]
    sp = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=1)
    scan = _llm("pallas", scan_layers=True)
    cfg = scan.engine.model_config
    assert _weight(scan, "layers__wqkv").shape == (cfg.num_layers,
                                                   cfg.q_size + 2 * cfg.kv_size,
                                                   cfg.hidden_size)
    got = scan.generate(prompts, sp)
    ref = _llm("pallas").generate(prompts, sp)
    _assert_same_outputs(got, ref, atol=1e-4)


def test_engine_fp8_on_kernels_equals_the_same_math_on_xla(monkeypatch, request):
    """matmul_backend="pallas": the weights are held [N, K] and decode runs the Triton W8A8
    kernel; the reference is the same plan on XLA's W8A8 (x quantized per token, FP8 dot)."""
    prompts = [[5, 6, 7], [9] * 9, list(range(10, 27))]
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=1)
    pal = _llm("pallas")
    assert pal.engine.runner.graphdef is not None
    qkv = _weight(pal, "layer0__wqkv")
    assert qkv.dtype == jnp.float8_e4m3fn
    cfg = pal.engine.model_config
    assert qkv.shape == (cfg.q_size + 2 * cfg.kv_size, cfg.hidden_size)  # [N, K]
    got = pal.generate(prompts, sp)

    real_plan = fp8_plan.fp8_engine_plan
    monkeypatch.setattr(fp8_plan, "fp8_engine_plan",
                        lambda M, K, N: ("xla", real_plan(M, K, N)[1]))
    # The kernel GEMM is a module-level jit whose traces would outlive the patch: drop them
    # (here and after the test) so the reference engine really runs the patched plan.
    jax.clear_caches()
    request.addfinalizer(jax.clear_caches)
    ref = _llm("pallas").generate(prompts, sp)
    _assert_same_outputs(got, ref, atol=1e-4)
    # and the kernels' W8A8 is not the XLA W8A16 path (the test can tell them apart)
    xla = _llm("xla").generate(prompts, sp)
    lp_x = [d[t] for o in xla for d, t in zip(o.outputs[0].logprobs,
                                                      o.outputs[0].token_ids)]
    lp_g = [d[t] for o in got for d, t in zip(o.outputs[0].logprobs,
                                                      o.outputs[0].token_ids)]
    assert not np.allclose(lp_x, lp_g, atol=1e-6, rtol=0)


def test_prefill_program_lowers_each_kernel_shape_once(monkeypatch):
    """The unrolled layers' FP8 GEMMs of one shape share one lowered function: the Mosaic
    GPU kernel bodies in an H200 prefill program do not grow with depth (lowering them per
    layer took ~130 s per 8B prefill program)."""
    from jaxinfer.batch import Bucket
    from tests.conftest import tiny_config

    counts = {}
    for layers in (2, 4):  # every projection here meets mgpu's tile rules (N % 256, K % 128)
        cfg = tiny_config("llama", hidden_size=256, intermediate_size=512, num_heads=4,
                          num_kv_heads=2, head_dim=64, num_layers=layers)
        text = _cuda_program_text(monkeypatch, cfg, Bucket("prefill", 512, 1, 4),
                                  max_num_batched_tokens=512, prefill_buckets=(512,))
        counts[layers] = text.count("mosaic_gpu")
    assert counts[2] > 0
    assert counts[4] == counts[2]


def test_decode_program_quantizes_each_projection_input_in_one_kernel(monkeypatch):
    """At decode rows on the Triton GEMM every FP8 projection's input is RMS-normalized (QKV,
    gate/up) and quantized per token by row_quant.norm_quant_fp8, one kernel per site, four
    per layer (XLA's reduction + convert pairs were 6 more CUDA-graph nodes a layer)."""
    import re

    from jaxinfer.batch import Bucket
    from tests.conftest import tiny_config

    cfg = tiny_config("llama", hidden_size=256, intermediate_size=512, num_heads=4,
                      num_kv_heads=2, head_dim=64, num_layers=3)
    text = _cuda_program_text(monkeypatch, cfg, Bucket("decode", 4, 4, 4),
                              max_num_batched_tokens=128, prefill_buckets=(128,))
    calls = re.findall(r"call @norm_quant_fp8(?:_\d+)?\((%\w+)(, %\w+)?\)", text)
    assert len(calls) == 4 * cfg.num_layers
    assert sum(1 for _, w in calls if w) == 2 * cfg.num_layers  # the normed ones


def test_fused_swiglu_quant_engine_equals_the_unfused_one(monkeypatch, request):
    """transformer.FUSE_SWIGLU_QUANT: at a 32-row decode bucket (gate/up's SwiGLU not in the
    GEMM's epilogue) SwiGLU and the down input's quantization run as one norm_quant_fp8
    (swiglu=True) and give the same tokens and logprobs as XLA's SwiGLU fusion, then the
    kernel (float32 engine); the H200 decode program then quantizes the [32, 2F] GEMM output
    in the kernel and has no SwiGLU outside it (an exponential fewer)."""
    from jaxinfer.batch import Bucket
    from jaxinfer.models import transformer as T
    from tests.conftest import tiny_config

    model = tiny_loaded("llama", hidden_size=64, head_dim=16)
    F, H = model.config.intermediate_size, model.config.hidden_size
    assert not fp8_plan.fp8_gate_up_in_epilogue(32, H, 2 * F)
    assert fp8_plan.fp8_takes_quantized_x(32, F, H)
    prompts = [[5, 6, 7], list(range(10, 27)), [40, 41]]
    sp = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=1)
    kw = dict(max_num_seqs=32, decode_buckets=(32,), dtype="float32")
    monkeypatch.setattr(T, "FUSE_SWIGLU_QUANT", False)
    ref = _llm("pallas", model, **kw).generate(prompts, sp)
    monkeypatch.setattr(T, "FUSE_SWIGLU_QUANT", True)
    jax.clear_caches()
    request.addfinalizer(jax.clear_caches)
    got = _llm("pallas", model, **kw).generate(prompts, sp)
    _assert_same_outputs(got, ref, atol=1e-5)

    cfg = tiny_config("llama", hidden_size=256, intermediate_size=512, num_heads=4,
                      num_kv_heads=2, head_dim=64, num_layers=3)
    exps, swiglu_quant = {}, {}
    for on in (False, True):
        monkeypatch.setattr(T, "FUSE_SWIGLU_QUANT", on)
        text = _cuda_program_text(monkeypatch, cfg, Bucket("decode", 32, 32, 4),
                                  max_num_seqs=32, decode_buckets=(32,),
                                  max_num_batched_tokens=128, prefill_buckets=(128,))
        exps[on] = text.count("stablehlo.exponential")  # sigmoid's, attention's, ...
        # norm_quant_fp8 functions taking the [32, 2F] gate/up output
        swiglu_quant[on] = len(re.findall(
            r"func\.func private @norm_quant_fp8\w*\(%arg0: tensor<32x1024xbf16>", text))
    assert swiglu_quant == {False: 0, True: 1}
    assert exps[True] < exps[False]


def test_a_kernel_switch_changed_in_process_retraces_the_fp8_gemm(monkeypatch):
    """The engine's FP8 GEMMs sit under a module-level ``jit`` (transformer._fp8_kernel_linear)
    whose traces outlive an engine, and the kernel switches are read while tracing: a switch
    changed between two engines of one process must give the second its own trace (session 14:
    an in-process fast-accum on / off A/B got the first engine's trace for every engine)."""
    from jaxinfer.models import transformer as T

    seen = []
    real = fp8_plan.fp8_engine_linear

    def spy(*args, **kwargs):  # runs only while _fp8_kernel_linear traces
        seen.append(fp8_plan._fp8_decode_fast_accum())
        return real(*args, **kwargs)

    monkeypatch.setattr(fp8_plan, "fp8_engine_linear", spy)
    M, K, N = 3, 128, 96  # a shape no other test traces
    h = jax.random.normal(jax.random.key(7), (M, K), F32).astype(jnp.bfloat16)
    wq, ws = quantize_rows_fp8(jax.random.normal(jax.random.key(8), (N, K), F32) / 16)
    w = {"wq": wq, "wq_scale": ws}
    outs = []
    for value in ("on", "off", "on", "off"):
        monkeypatch.setenv("JAXINFER_FP8_DECODE_FAST_ACCUM", value)
        outs.append(np.asarray(T._proj(h, w, "wq", kernels=True, interpret=True), np.float32))
    assert seen == [True, False]  # one trace per value, reused when the value comes back
    ref = np.asarray(linear_ref(*quantize_rows_fp8(h)[:1], wq, ws, quantize_rows_fp8(h)[1],
                                out_dtype=F32))
    for out in outs:
        assert out.shape == (M, N) and np.linalg.norm(out - ref) / np.linalg.norm(ref) < 1e-2


def _force_split_k(monkeypatch) -> None:
    """Two K splits wherever K allows (triton_gemm.split_to_fill asks for 1024 K a split, so
    only hidden sizes >= 2048 would split: slow in interpret mode)."""
    from pallas_kernels.matmul import triton_gemm

    monkeypatch.setattr(triton_gemm, "split_to_fill",
                        lambda programs, K, bk, target=264: 2 if K % (2 * bk) == 0 else 1)


def test_rope_kv_write_takes_the_qkv_gemms_split_k_partials(monkeypatch, request):
    """The FP8 QKV GEMM at the 4-row decode bucket split in two (forced at hidden 512) and
    hands its float32 partials unsummed (triton_gemm.SplitKPartials) to the attention
    backend; with pallas_attention.ROPE_KV_WRITE_KERNEL the RoPE + KV write kernel sums them
    (its epilogue) and the engine's greedy tokens and logprobs equal XLA's path (float32
    engine, FP8 KV); off, the backend reduces them as XLA did before. The H200 decode program
    then hands the [2, 4, 512] partials straight to the kernel."""
    import re

    from jaxinfer.batch import Bucket
    from jaxinfer.layers import attention
    from jaxinfer.layers import pallas_attention as pa
    from pallas_kernels.matmul import triton_gemm
    from tests.conftest import tiny_config

    _force_split_k(monkeypatch)
    H = 512
    assert fp8_plan.fp8_decode_config(4, H, 512).split_k == 2
    model = tiny_loaded("llama", hidden_size=H, intermediate_size=128, num_heads=4,
                        num_kv_heads=2, head_dim=64, num_layers=1)
    prompts = [[5, 6, 7], list(range(10, 27))]
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=1)
    seen = []
    real = pa.rope_write_kv_pallas
    monkeypatch.setattr(pa, "rope_write_kv_pallas", lambda *a, **k: seen.append(
        type(a[3]).__name__) or real(*a, **k))
    request.addfinalizer(jax.clear_caches)
    outs = {}
    for on in (False, True):
        monkeypatch.setattr(pa, "ROPE_KV_WRITE_KERNEL", on)
        jax.clear_caches()
        outs[on] = _llm("pallas", model, dtype="float32", kv_cache_dtype="fp8",
                        attention_backend="pallas").generate(prompts, sp)
    assert set(seen) == {triton_gemm.SplitKPartials.__name__}
    _assert_same_outputs(outs[True], outs[False], atol=1e-5)

    monkeypatch.setattr(attention.jax, "default_backend", lambda: "gpu")
    cfg = tiny_config("llama", hidden_size=H, intermediate_size=512, num_heads=4,
                      num_kv_heads=2, head_dim=64, num_layers=2)
    text = _cuda_program_text(monkeypatch, cfg, Bucket("decode", 4, 4, 4),
                              max_num_batched_tokens=128, prefill_buckets=(128,),
                              attention_backend="pallas", kv_cache_dtype="fp8")
    calls = re.findall(r"call @_rope_write\(([^)]*)\) : \(([^)]*)\)", text)
    assert len(calls) == 2
    assert all("tensor<2x4x512xf32>" in types for _, types in calls)


@pytest.mark.parametrize("scan", [False, True])
def test_split_k_residual_fused_engine_equals_xla(scan, monkeypatch, request):
    """transformer.FUSE_SPLITK_RESIDUAL with the decode GEMMs split in two (forced at hidden
    / q_size / intermediate 512): the o projection's partials are summed and added inside the
    gate/up norm-quant and (unrolled) the down projection's inside the next layer's QKV
    norm-quant, the last one before the final norm; the float32 engine's greedy tokens and
    logprobs equal XLA's epilogue + add. The H200 decode program (2 layers, unrolled) then
    hands [2, 4, 512] partials to 3 norm-quant kernels (both gate/up sites, the second
    layer's QKV site)."""
    import re

    from jaxinfer.batch import Bucket
    from jaxinfer.models import transformer as T
    from tests.conftest import tiny_config

    _force_split_k(monkeypatch)
    H = 512
    assert fp8_plan.fp8_decode_config(4, H, H).split_k == 2
    dims = dict(hidden_size=H, intermediate_size=H, num_heads=8, num_kv_heads=4,
                head_dim=64, num_layers=2)
    model = tiny_loaded("llama", **dims)
    prompts = [[5, 6, 7], list(range(10, 27))]
    sp = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=1)
    from pallas_kernels.matmul import row_quant

    seen, residuals = [], {}
    real = T._reduced
    monkeypatch.setattr(T, "_reduced", lambda f: seen.append(type(f).__name__) or real(f))
    real_nq = row_quant.norm_quant_fp8

    def spy_nq(*a, residual=None, **k):  # the kinds of residual the norm-quants take
        residuals.setdefault(on, set()).add(type(residual).__name__)
        return real_nq(*a, residual=residual, **k)

    monkeypatch.setattr(row_quant, "norm_quant_fp8", spy_nq)
    request.addfinalizer(jax.clear_caches)
    outs = {}
    for on in (False, True):
        monkeypatch.setattr(T, "FUSE_SPLITK_RESIDUAL", on)
        jax.clear_caches()
        outs[on] = _llm("pallas", model, dtype="float32", scan_layers=scan,
                        **_DECODE_ONLY).generate(prompts, sp)
    _assert_same_outputs(outs[True], outs[False], atol=1e-5)
    # on, the o projection's partials reach a norm-quant (scanned too); off, none do
    assert "SplitKPartials" in residuals[True] and "SplitKPartials" not in residuals[False]
    if scan:  # no carry: f reduced where it is made; o's partials still go unsummed
        return
    assert "SplitKPartials" in seen  # the last layer's f, before the final norm
    # with the RoPE + KV write kernel too (the QKV site: residual in, partials out)
    from jaxinfer.layers import pallas_attention as pa

    monkeypatch.setattr(pa, "ROPE_KV_WRITE_KERNEL", True)
    jax.clear_caches()
    both = _llm("pallas", model, dtype="float32", kv_cache_dtype="fp8",
                attention_backend="pallas", **_DECODE_ONLY).generate(prompts, sp)
    monkeypatch.setattr(T, "FUSE_SPLITK_RESIDUAL", False)
    monkeypatch.setattr(pa, "ROPE_KV_WRITE_KERNEL", False)
    jax.clear_caches()
    neither = _llm("pallas", model, dtype="float32", kv_cache_dtype="fp8",
                   attention_backend="pallas", **_DECODE_ONLY).generate(prompts, sp)
    _assert_same_outputs(both, neither, atol=1e-5)
    monkeypatch.setattr(T, "FUSE_SPLITK_RESIDUAL", True)
    cfg = tiny_config("llama", **dims)
    text = _cuda_program_text(monkeypatch, cfg, Bucket("decode", 4, 4, 4),
                              max_num_batched_tokens=128, prefill_buckets=(128,))
    names = re.findall(r"func\.func private @(norm_quant_fp8\w*)\(([^)]*)\)", text)
    with_parts = {n for n, a in names if "tensor<2x4x512xf32>" in a}
    calls = re.findall(r"call @(norm_quant_fp8\w*)\(", text)
    assert sum(c in with_parts for c in calls) == 3
