"""The engine with the Pallas attention backend (interpret mode on CPU) equals the reference."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from jaxinfer import LLM, SamplingParams
from tests.conftest import tiny_loaded


def test_pallas_backend_greedy_equals_reference():
    prompts = [[5, 6, 7], [9] * 9, list(range(10, 27))]
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    kw = dict(max_model_len=64, block_size=16, max_num_seqs=4, max_num_batched_tokens=64,
              decode_buckets=(4,), prefill_buckets=(64,), page_buckets=(4,))
    ref = LLM(tiny_loaded("llama", head_dim=16), attention_backend="reference", **kw)
    pal = LLM(tiny_loaded("llama", head_dim=16), attention_backend="pallas", **kw)
    assert pal.engine.runner.attention.name == "pallas"
    want = [o.outputs[0].token_ids for o in ref.generate(prompts, sp)]
    got = [o.outputs[0].token_ids for o in pal.generate(prompts, sp)]
    assert got == want
    assert pal.engine.runner.cache.dtype == jnp.float32


def test_kv_write_kernel_engine_equals_the_scatter(monkeypatch):
    """pallas_attention.KV_WRITE_KERNEL: the engine's K/V written by the Pallas kernel
    (interpret mode) give the same greedy tokens and logprobs as XLA's scatter, with an
    FP8 KV cache (the kernel quantizes on the way in) and prompts across page boundaries."""
    import numpy as np

    from jaxinfer.layers import pallas_attention as pa

    prompts = [[5, 6, 7], [9] * 16, list(range(10, 27))]
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=1)
    kw = dict(max_model_len=64, block_size=16, max_num_seqs=4, max_num_batched_tokens=64,
              decode_buckets=(4,), prefill_buckets=(64,), page_buckets=(4,),
              kv_cache_dtype="fp8")
    outs, traced = {}, []
    real = pa.write_kv_pallas
    monkeypatch.setattr(pa, "write_kv_pallas",
                        lambda *a, **k: traced.append(1) or real(*a, **k))
    for on in (False, True):
        monkeypatch.setattr(pa, "KV_WRITE_KERNEL", on)
        llm = LLM(tiny_loaded("llama", head_dim=16), attention_backend="pallas", **kw)
        outs[on] = llm.generate(prompts, sp)
        assert bool(traced) == on  # the kernel is in the programs only when switched on
    for a, b in zip(outs[True], outs[False]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        lp = [[d[t] for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
              for o in (a, b)]
        np.testing.assert_allclose(lp[0], lp[1], atol=1e-5)


@pytest.mark.parametrize("family,extra", [
    ("llama", {}), ("llama", {"attention_bias": True}), ("llama", {"qk_norm": True}),
    ("gemma3", {})])
@pytest.mark.parametrize("kv, atol", [("auto", 1e-5), ("fp8", 1e-4)])
def test_rope_kv_write_kernel_engine_equals_xla(monkeypatch, family, extra, kv, atol):
    """pallas_attention.ROPE_KV_WRITE_KERNEL: decode steps take QKV bias (Qwen2), QK norm
    (Qwen3), RoPE (Gemma 3: local and global frequencies, sliding layers) and the K / V
    write in one Pallas kernel (interpret mode) from the QKV output and give the same greedy
    tokens and logprobs as XLA's path (float32 engine; a float32 KV cache, and an FP8 one:
    the kernel quantizes K / V on the way in); prefill keeps XLA's. Unrolled layers, and
    scanned ones (a traced layer index) for Llama and Gemma 3.

    The float32 rotation (and QK norm) may round the last bit differently from XLA's fusion
    (FMA contraction: on session 27's CPU a quarter of q's values differ by an ulp; the
    kernel's contract, checked on the GPU by check_rope_kv_write, is <= 1 representable
    step). Through a float32 cache that moves a logprob by ~1e-6; through an FP8 cache one
    such ulp can flip a K value to the neighbouring e4m3 value, which moved a logprob by
    2.4e-5 there: the FP8 case's 1e-4 (a wrong rotation, norm or scale moves them by
    > 1e-2)."""
    import numpy as np

    from jaxinfer.layers import pallas_attention as pa

    prompts = [[5, 6, 7], [9] * 16, list(range(10, 27))]
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=1)
    kw = dict(max_model_len=64, block_size=16, max_num_seqs=4, max_num_batched_tokens=64,
              decode_buckets=(4,), prefill_buckets=(64,), page_buckets=(4,),
              kv_cache_dtype=kv, dtype="float32")
    real = pa.rope_write_kv_pallas
    # scanned: the layer index the kernel gets (KV cache layer, Gemma 3's window and
    # frequencies) is traced; bias and QK-norm weights reach it as in the unrolled program
    for scan in (False,) if extra else (False, True):
        outs, traced = {}, []
        monkeypatch.setattr(pa, "rope_write_kv_pallas",
                            lambda *a, **k: traced.append(a[3].shape[0]) or real(*a, **k))
        for on in (False, True):
            monkeypatch.setattr(pa, "ROPE_KV_WRITE_KERNEL", on)
            llm = LLM(tiny_loaded(family, head_dim=32, **extra), attention_backend="pallas",
                      scan_layers=scan, **kw)
            outs[on] = llm.generate(prompts, sp)
            assert bool(traced) == on  # in the programs only when switched on
        assert set(traced) == {4}  # decode buckets only, not the 64-token prefill
        for a, b in zip(outs[True], outs[False]):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            lp = [[d[t] for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
                  for o in (a, b)]
            np.testing.assert_allclose(lp[0], lp[1], atol=atol)


def test_rope_kv_write_kernel_in_the_h200_decode_program(monkeypatch):
    """With ROPE_KV_WRITE_KERNEL the unrolled H200 decode program (bf16, FP8 KV) runs one
    rope_kv_write kernel a layer and no scatter (XLA's K / V writes), with and without QKV
    bias and QK norm (the kernel takes the bias vectors and norm weights as operands); a
    decode bucket of more than ROPE_KV_WRITE_MAX_TOKENS tokens keeps XLA's rotation and
    scatters (the kernel is slower there: 7.1 vs 4.4 µs a layer at 256 tokens, H100)."""
    from jaxinfer.batch import Bucket
    from jaxinfer.layers import attention
    from jaxinfer.layers import pallas_attention as pa
    from tests.conftest import tiny_config
    from tests.engine.test_fp8_kernels import _cuda_program_text

    monkeypatch.setattr(attention.jax, "default_backend", lambda: "gpu")
    for on, max_tokens in ((True, 64), (False, 64), (True, 3)):
        monkeypatch.setattr(pa, "ROPE_KV_WRITE_KERNEL", on)
        monkeypatch.setattr(pa, "ROPE_KV_WRITE_MAX_TOKENS", max_tokens)
        in_program = on and max_tokens >= 4  # the bucket's 4 tokens
        for extra in ({}, {"attention_bias": True, "qk_norm": True}):
            cfg = tiny_config("llama", hidden_size=256, intermediate_size=512, num_heads=4,
                              num_kv_heads=2, head_dim=64, num_layers=3, **extra)
            text = _cuda_program_text(
                monkeypatch, cfg, Bucket("decode", 4, 4, 4), max_num_batched_tokens=128,
                prefill_buckets=(128,), attention_backend="pallas", kv_cache_dtype="fp8",
                quantization=None, matmul_backend="xla")
            if in_program:
                assert 'name = "rope_kv_write"' in text  # the kernel, under its own jit
                assert text.count("call @_rope_write(") == 3
                assert "stablehlo.scatter" not in text
            else:
                assert "rope_kv_write" not in text
                assert text.count("stablehlo.scatter") >= 2 * 3
