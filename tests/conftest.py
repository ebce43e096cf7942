"""Shared fixtures: tiny random models that need no checkpoint on disk."""

from __future__ import annotations

import os
from types import SimpleNamespace

import numpy as np
import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

# Identical tiny programs are compiled by many engines across the suite: share them through
# JAX's persistent compilation cache (the mechanism `jaxinfer compile` builds on).
_CACHE = os.path.join(os.path.dirname(__file__), "..", ".cache", "jax-test-compilation-cache")
jax.config.update("jax_compilation_cache_dir", os.path.abspath(_CACHE))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
# `jaxinfer generate | chat | serve` run as subprocesses use the same cache, not ~/.cache
os.environ.setdefault("JAXINFER_XLA_CACHE_DIR", os.path.abspath(_CACHE))

from jaxinfer.config import ModelConfig  # noqa: E402
from jaxinfer.models.params import param_shapes  # noqa: E402


def tiny_config(family: str = "llama", **kw) -> ModelConfig:
    base = dict(family=family, vocab_size=96, hidden_size=32, intermediate_size=64,
                num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8,
                max_position_embeddings=256, eos_token_ids=(1,), name=f"tiny-{family}")
    if family == "gemma3":
        base.update(qk_norm=True, post_norms=True, hidden_act="gelu_pytorch_tanh",
                    layer_types=("sliding_attention", "sliding_attention", "full_attention"),
                    sliding_window=6, rope_local_base_freq=1e4, rope_theta=1e6,
                    embed_scale=32 ** 0.5, query_pre_attn_scalar=8, tie_word_embeddings=True)
    base.update(kw)
    return ModelConfig(**base)


def tiny_loaded(family: str = "llama", seed: int = 0, **kw) -> SimpleNamespace:
    """A LoadedModel-like bundle with random weights (peaky logits: few greedy ties)."""
    cfg = tiny_config(family, **kw)
    rng = np.random.default_rng(seed)
    params = {}
    for name, shape in param_shapes(cfg).items():
        if "norm" in name:
            params[name] = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            fan_in = shape[-2] if len(shape) >= 2 else 1
            params[name] = (rng.standard_normal(shape) / np.sqrt(fan_in)).astype(np.float32)
    params["embed"] *= 4.0
    return SimpleNamespace(config=cfg, params=params, tokenizer=None, source=f"tiny-{family}")


@pytest.fixture(params=["llama", "gemma3"])
def tiny_family(request) -> str:
    return request.param


@pytest.fixture(scope="session")
def smollm_tokenizer():
    """SmolLM2-135M-Instruct's tokenizer, read without its weights; skips when the model
    package is not installed."""
    from jaxinfer.loading import CheckpointError, read_header

    try:
        tokenizer = read_header("smollm2-135m")[1]
    except CheckpointError as e:
        pytest.skip(str(e))
    assert tokenizer is not None, "smollm2-135m has no tokenizer in its metadata"
    return tokenizer
