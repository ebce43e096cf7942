"""FP8 (e4m3) KV cache, ``kv_cache_dtype="fp8"``: config and CLI, the quantizing write, the
reference backend against the unquantized cache, the Pallas kernels (interpret mode) against
the reference, and scales that are used the same way on write and read.

Tolerances, in units of e4m3's unit roundoff u = 2^-4 (3 mantissa bits: round-to-nearest
puts each stored K/V element within u of its value, relative, in the normal range; RMS about
u/sqrt(3); measured on the tiny llama's cache: 2.6 % RMS). Attention takes that error from K
(through the softmax) and from V (through the weighted sum), and each of the 3 layers adds
its own on top of what earlier layers passed on, so the logits of a prompt move by up to
about 2u of their norm (asserted < 2^-3; measured 2-6.5 % on random tiny models, which
amplify perturbations more than trained ones) and single rows by up to about 4u (asserted
< 2^-2; measured worst 12.6 %). A scale applied on write but not on read would be off by
the scale itself (>= 50 % for the scales tested); an unquantized cache by 0 (asserted
> 2^-10). The Pallas kernels widen FP8 to f16 for their dots (q and the probabilities are
rounded to f16: 2^-11 relative), so against the reference with the same FP8 cache they agree
to about 1e-3 of the logits' norm (asserted: 1e-2).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from jaxinfer import cli
from jaxinfer.config import ConfigError, EngineConfig
from jaxinfer.layers.attention import AttentionBackend, allocate_kv_cache
from jaxinfer.llm import LLM
from jaxinfer.sampling_params import SamplingParams
from pallas_kernels.paged_attention import paged_decode_attention_ref
from tests.conftest import tiny_loaded

E4M3 = ml_dtypes.float8_e4m3fn
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
KW = {"max_model_len": 64, "block_size": 4, "max_num_seqs": 4, "max_num_batched_tokens": 64}
PROMPTS = [np.random.default_rng(0).integers(2, 96, n).tolist() for n in (5, 17, 40)]


def _run(llm: LLM) -> tuple[list[list[int]], list[np.ndarray]]:
    """Greedy tokens of PROMPTS and each prompt's logits [T, V]."""
    tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    return tokens, [llm.engine.prompt_logits(p) for p in PROMPTS]


def _rel(a: np.ndarray, b: np.ndarray, axis=None) -> np.ndarray:
    return np.linalg.norm(a - b, axis=axis) / np.linalg.norm(a, axis=axis)


def _set_scales(llm: LLM, k_scale: float, v_scale: float) -> None:
    """Give a fresh engine's FP8 pool other per-layer scales (before any K/V is written)."""
    r, cfg = llm.engine.runner, llm.engine.model_config
    L = cfg.num_layers
    r.cache = allocate_kv_cache(L, cfg.num_kv_heads, r.num_pages, r.page_size, cfg.head_dim,
                                r.cache.dtype, (np.full(L, k_scale), np.full(L, v_scale)),
                                per_layer=r.cache.per_layer)


# ----------------------------------------------------------------------------- options
@pytest.mark.parametrize("value", ["auto", "fp8", "fp8_e4m3"])
def test_config_accepts_vllm_names(value):
    assert EngineConfig(kv_cache_dtype=value).kv_cache_dtype == value


@pytest.mark.parametrize("value, match", [
    ("fp8_e5m2", "e5m2 is not implemented"), ("int8", "kv_cache_dtype must be one of"),
    ("bfloat16", "got 'bfloat16'")])
def test_config_rejects_other_dtypes(value, match):
    with pytest.raises(ConfigError, match=match):
        EngineConfig(kv_cache_dtype=value)


@pytest.mark.parametrize("command", ["generate", "chat", "serve", "compile"])
def test_cli_flag_reaches_the_engine_options(command):
    extra = ["prompt"] if command == "generate" else []
    parser = cli.build_parser()
    ns = parser.parse_args([command, "--kv-cache-dtype", "fp8_e4m3", *extra])
    assert cli._engine_args(ns)["kv_cache_dtype"] == "fp8_e4m3"
    assert "kv_cache_dtype" not in cli._engine_args(parser.parse_args([command, *extra]))
    with pytest.raises(SystemExit):
        parser.parse_args([command, "--kv-cache-dtype", "fp8_e5m2", *extra])


def test_bad_scales_are_refused():
    with pytest.raises(ValueError, match="FP8 KV cache only"):
        allocate_kv_cache(2, 1, 3, 4, 8, np.float32, (np.ones(2), np.ones(2)))
    with pytest.raises(ValueError, match="k_scale must be 2 finite positive"):
        allocate_kv_cache(2, 1, 3, 4, 8, E4M3, (np.array([1.0, 0.0]), np.ones(2)))
    with pytest.raises(ValueError, match="v_scale must be 2 finite positive"):
        allocate_kv_cache(2, 1, 3, 4, 8, E4M3, (np.ones(2), np.ones(3)))
    c = allocate_kv_cache(2, 1, 3, 4, 8, E4M3)
    assert c.dtype == E4M3 and np.array_equal(np.asarray(c.k_scale), [1.0, 1.0])
    assert allocate_kv_cache(2, 1, 3, 4, 8, np.float32).k_scale is None


def test_per_layer_pools_keep_one_scale_buffer_a_layer():
    """Unrolled models' pools: each layer's scales are their own [1] arrays, and
    layer_scales gives the same scalars as the stacked pool's [L] vectors."""
    sc = (np.array([0.5, 2.0, 3.0]), np.array([0.25, 1.5, 4.0]))
    stacked = allocate_kv_cache(3, 1, 3, 4, 8, E4M3, sc)
    per = allocate_kv_cache(3, 1, 3, 4, 8, E4M3, sc, per_layer=True)
    assert isinstance(per.k_scale, tuple) and all(a.shape == (1,) for a in per.k_scale)
    for layer in range(3):
        got, want = per.layer_scales(layer), stacked.layer_scales(layer)
        assert [float(x) for x in got] == [float(x) for x in want] == [sc[0][layer],
                                                                       sc[1][layer]]
        assert all(x.shape == () for x in got)


def test_unrolled_fp8_decode_program_slices_no_scale_vector(monkeypatch):
    """The unrolled FP8-KV decode program for an H200 (Pallas attention) hands each layer's
    scales to the kernels as whole buffers: no slice of an [L] vector, which XLA:GPU made a
    device copy for every layer's K and V scale (64 memcpy launches an 8B step)."""
    import re

    import jax

    from jaxinfer.batch import Bucket
    from jaxinfer.layers import attention
    from tests.conftest import tiny_config
    from tests.engine.test_fp8_kernels import _cuda_program_text

    # the Pallas backend's kernels as on a GPU (not interpret mode) for the CUDA lowering
    monkeypatch.setattr(attention.jax, "default_backend", lambda: "gpu")
    cfg = tiny_config("llama", hidden_size=256, intermediate_size=512, num_heads=4,
                      num_kv_heads=2, head_dim=64, num_layers=3)
    text = _cuda_program_text(monkeypatch, cfg, Bucket("decode", 4, 4, 4),
                              max_num_batched_tokens=128, prefill_buckets=(128,),
                              attention_backend="pallas", kv_cache_dtype="fp8",
                              quantization=None, matmul_backend="xla")
    assert jax.default_backend() == "gpu"
    assert text.count("__gpu$xla.gpu.triton") >= cfg.num_layers  # the Pallas decode kernel
    assert not re.findall(r"\(tensor<3xf32>\) -> tensor<1xf32>", text)
    assert "tensor<3xf32>" not in text  # no [L] scale vector at all


# ----------------------------------------------------------------------------- write / read
def test_write_quantizes_with_saturation_and_read_dequantizes():
    L, Hkv, P, ps, D = 2, 2, 3, 4, 8
    rng = np.random.default_rng(1)
    k = rng.standard_normal((3, Hkv, D)).astype(np.float32) * 3
    v = rng.standard_normal((3, Hkv, D)).astype(np.float32)
    k[0, 0, :4] = [1000.0, -1000.0, 897.0, 895.0]  # / 2 -> saturates, saturates, 448.5, 447.5
    v[1, 1, :3] = [200.0, -113.0, 1e-4]  # / 0.25 -> 800 (saturates), -452 (saturates), tiny
    ks, vs = np.float32(2.0), np.float32(0.25)
    slots = np.array([1 * ps + 2, 2 * ps + 0, 0], np.int32)  # page 1 off 2, page 2 off 0, null
    c = allocate_kv_cache(L, Hkv, P, ps, D, E4M3)
    kc, vc = AttentionBackend().write(c.k, c.v, 1, k, v, slots, k_scale=ks, v_scale=vs)
    kc, vc = np.asarray(kc), np.asarray(vc)

    def want(x, s):  # round-to-nearest of the clipped value: ml_dtypes' own cast
        return np.clip(x / s, -448, 448).astype(E4M3)

    for t, (page, off) in enumerate([(1, 2), (2, 0), (0, 0)]):
        assert np.array_equal(kc[1, :, page, off], want(k[t], ks))
        assert np.array_equal(vc[1, :, page, off], want(v[t], vs))
    assert kc[1, 0, 1, 2, :4].astype(np.float32).tolist() == [448.0, -448.0, 448.0, 448.0]
    assert vc[1, 1, 2, 0, :2].astype(np.float32).tolist() == [448.0, -448.0]
    assert not np.isnan(kc.astype(np.float32)).any() and not np.isnan(vc.astype(np.float32)).any()
    untouched = np.ones((L, Hkv, P, ps), bool)
    untouched[1, :, [1, 2, 0], [2, 0, 0]] = False
    assert not kc.astype(np.float32)[untouched].any() and not vc.astype(np.float32)[untouched].any()

    # Read: a one-token context attends only to itself, so decode returns that token's
    # dequantized V: stored * v_scale.
    q = rng.standard_normal((1, 2 * Hkv, D)).astype(np.float32)
    out = paged_decode_attention_ref(q, kc, vc, 1, np.array([[2]], np.int32),
                                     np.array([1], np.int32), scale=0.3, k_scale=ks,
                                     v_scale=vs)
    deq = want(v[1], vs).astype(np.float32) * vs  # [Hkv, D]
    np.testing.assert_allclose(np.asarray(out)[0], np.repeat(deq, 2, axis=0), rtol=1e-6)


# ----------------------------------------------------------------------------- engine
def test_reference_fp8_close_to_unquantized(tiny_family):
    """Logits of the FP8 cache within e4m3's error of the float32 cache's, and free-running
    greedy tokens equal except after a near tie.

    Measured on 16 random prompts x 8 tokens: 10/16 sequences identical for tiny llama,
    15/16 for tiny gemma3. These random models have small top-2 margins (llama: median 0.24
    for logits of std ~0.9; 10 % of steps below 0.05) while the FP8 cache moves a logit by up
    to ~0.1-0.3, so some steps legitimately flip; a flip must be a swap of the reference's
    two best tokens (FP8's pick is float32's runner-up), after which the sequences differ.
    """
    rng = np.random.default_rng(5)
    prompts = [rng.integers(2, 96, int(n)).tolist() for n in rng.integers(3, 40, 16)]
    f32 = LLM(tiny_loaded(tiny_family), **KW)
    fp8 = LLM(tiny_loaded(tiny_family), kv_cache_dtype="fp8", **KW)
    assert fp8.engine.runner.cache.dtype == E4M3
    want = [o.outputs[0].token_ids for o in f32.generate(prompts, GREEDY)]
    got = [o.outputs[0].token_ids for o in fp8.generate(prompts, GREEDY)]
    equal = 0
    for p, w, g in zip(prompts, want, got):
        # Both caches on the same (float32-greedy) tokens: rows len(p)-1 ... predict w.
        a, b = f32.engine.prompt_logits(p + w), fp8.engine.prompt_logits(p + w)
        assert 2.0 ** -10 < _rel(a, b) < 2.0 ** -3  # quantized, within ~2u (module docstring)
        assert np.max(_rel(a, b, axis=-1)) < 2.0 ** -2  # every row within ~4u
        if g == w:
            equal += 1
            continue
        j = next(i for i in range(len(w)) if g[i] != w[i])
        row = a[len(p) - 1 + j]
        assert w[j] == int(np.argmax(row))
        assert g[j] == int(np.argsort(row)[-2]), (p, w, g, j)  # a swap of the two best
    assert equal >= 8, f"only {equal}/16 greedy sequences equal"


def test_power_of_two_scales_only_shift_the_stored_values():
    # x / 2^k rounds like x (e4m3 is binary floating point) away from the subnormal and
    # saturation edges, so scales 2 and 1/2 give the scale-1 logits almost exactly: only the
    # ~1-2 % of elements near e4m3's subnormal range (|x| < 2^-6 * scale) round differently
    # (measured 0.3 %). A write and a read that disagreed on the scale would be off by 2x
    # (V) or in every softmax (K).
    _, one = _run(LLM(tiny_loaded("llama"), kv_cache_dtype="fp8", **KW))
    llm = LLM(tiny_loaded("llama"), kv_cache_dtype="fp8", **KW)
    _set_scales(llm, 2.0, 0.5)
    _, shifted = _run(llm)
    for a, b in zip(one, shifted):
        assert _rel(a, b) < 2.0 ** -6


@pytest.mark.parametrize("block_size", [16, 64])
def test_pallas_fp8_equals_reference_fp8(block_size):
    """At the default 16-token pages and at 64 (one page a sequence: the kernels' steps are
    raised to the page, prefill chunks and the KV write stay inside one page)."""
    kw = dict(KW, block_size=block_size, decode_buckets=(4,), prefill_buckets=(64,),
              page_buckets=(64 // block_size,))
    out = {}
    for backend in ("reference", "pallas"):
        llm = LLM(tiny_loaded("llama", head_dim=16), attention_backend=backend,
                  kv_cache_dtype="fp8", **kw)
        assert llm.engine.runner.attention.name == backend
        _set_scales(llm, 0.75, 1.5)  # not powers of two: both sides must apply them
        out[backend] = _run(llm)
    assert out["pallas"][0] == out["reference"][0]
    for a, b in zip(out["reference"][1], out["pallas"][1]):
        assert _rel(a, b) < 1e-2
