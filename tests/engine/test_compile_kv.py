"""The KV pool `jaxinfer compile` fixes (jaxinfer/compile_kv.py): on a device with
``memory_stats()`` (faked here on the CPU) the pool an engine started there without the cache
sizes, capped at max_num_seqs full sequences; weights counted from the shapes (bf16, FP8);
an engine started with the cache adopts it."""

from __future__ import annotations

import json
import math

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from jaxinfer import cli, kv_pages_memo, kv_sizing
from jaxinfer.compile_kv import (
    abstract_net,
    estimate_activation_bytes,
    probe_depths,
    size_for_compile,
    weights_device_bytes,
)
from jaxinfer.config import ConfigError, EngineConfig
from jaxinfer.engine import LLMEngine
from jaxinfer.engine_config import engine_config_for
from jaxinfer.kv_sizing import kv_page_bytes, profile_activation_bytes
from jaxinfer.loading import DUMMY_CONFIGS
from jaxinfer.models.params import FP8_PROJECTIONS, param_shapes
from jaxinfer.models.transformer import CausalLM
from tests.conftest import tiny_config, tiny_loaded

GIB = 2**30
MODEL = "dummy:tiny-llama"
ENGINE = {"max_model_len": 64, "block_size": 16, "max_num_seqs": 2,
          "max_num_batched_tokens": 16, "max_prefill_seqs": 2}
CLI_ENGINE = ["--max-model-len", "64", "--block-size", "16", "--max-num-seqs", "2",
              "--max-num-batched-tokens", "16", "--max-prefill-seqs", "2"]


def _fake_device(monkeypatch, limit: int, in_use: int = 0) -> None:
    monkeypatch.setattr(kv_sizing, "device_memory_stats",
                        lambda: {"bytes_limit": limit, "bytes_in_use": in_use})


def _expected_bf16_fp8(cfg) -> tuple[int, int]:
    """(bf16 bytes, FP8 bytes) of ``cfg``'s weights, from param_shapes: FP8 projections 1 B
    per element plus a float32 scale per layer and output channel, the rest bf16."""
    shapes = param_shapes(cfg)
    bf16 = sum(math.prod(s) for s in shapes.values()) * 2
    fp8 = sum(math.prod(s) * (1 if n in FP8_PROJECTIONS else 2) for n, s in shapes.items())
    fp8 += sum(s[0] * s[-1] * 4 for n, s in shapes.items() if n in FP8_PROJECTIONS)
    return bf16, fp8


def test_weights_from_shapes_bf16_and_fp8_8b():
    cfg = DUMMY_CONFIGS["llama-3.1-8b"]
    bf16, fp8 = _expected_bf16_fp8(cfg)
    assert bf16 == 16_060_522_496  # 8,030,261,248 params (RESULTS: "weights 14.96 GiB")
    for quant, want in ((None, bf16), ("fp8", fp8)):
        ec = EngineConfig(max_model_len=4352, dtype="bfloat16", quantization=quant)
        assert weights_device_bytes(abstract_net(cfg, ec)) == want
    # 6.98e9 B of e4m3 projections + 5.5e6 B of scales + 2.10e9 B bf16 embed and lm_head.
    assert fp8 == 9_086_705_664


@pytest.mark.parametrize("quant", [None, "fp8"])
def test_weights_from_shapes_are_the_engines_arrays(quant):
    """The abstract count equals the bytes a real CausalLM holds (fused projections, FP8
    weights and scales), the arrays an engine's bytes_in_use counts."""
    loaded = tiny_loaded()
    ec = EngineConfig(max_model_len=64, quantization=quant)  # float32 on the CPU
    real = CausalLM(loaded.config, loaded.params, np.float32, quantization=quant)
    held = sum(x.nbytes for x in jax.tree_util.tree_leaves(nnx.state(real)))
    assert weights_device_bytes(abstract_net(loaded.config, ec)) == held
    if quant == "fp8":
        assert any(x.dtype == ml_dtypes.float8_e4m3fn
                   for x in jax.tree_util.tree_leaves(nnx.state(real)))


def test_probe_depths():
    assert probe_depths(DUMMY_CONFIGS["llama-3.1-8b"]) == (3, 4)
    assert probe_depths(DUMMY_CONFIGS["tiny-llama"]) is None  # 2 layers: probe them all
    assert probe_depths(DUMMY_CONFIGS["tiny-gemma3"]) is None  # 6: one pattern period
    g = DUMMY_CONFIGS["tiny-gemma3"]
    deep = g.replace(num_layers=26, layer_types=(g.layer_types * 5)[:26])
    assert probe_depths(deep) == (6, 12)


@pytest.mark.parametrize("quant", [None, "fp8"])
def test_shallow_probes_extend_to_the_full_probe(quant):
    """An 8-layer model: the 3- and 4-layer estimate (5 % margin included) is not below
    the engine's own full-depth probe (never more pages than the engine) and within 10 % of
    it. (Without the margin the float32 one falls 1.6 % short: 62,352 B against 63,376.)"""
    cfg = tiny_config(num_layers=8)
    ec = engine_config_for(cfg, {**ENGINE, "quantization": quant})
    est, how = estimate_activation_bytes(cfg, ec, np.float32)
    full = profile_activation_bytes(abstract_net(cfg, ec), ec, np.float32)
    assert "3- and 4-layer probes" in how
    assert full <= est <= 1.1 * full


def test_device_memory_limits_the_pool_as_the_engine_would(monkeypatch):
    """Faked device memory: the compile's pool equals the pool an engine without the cache
    sizes on that device (whose bytes_in_use holds its weights), and the total when
    memory is ample; a budget below one sequence is a ConfigError."""
    mc = DUMMY_CONFIGS["tiny-llama"]
    ec = engine_config_for(mc, ENGINE)
    assert ec.total_kv_pages == 9 and ec.max_pages_per_seq == 4
    page = kv_page_bytes(mc, 16, np.float32)
    weights = weights_device_bytes(abstract_net(mc, ec))
    act = profile_activation_bytes(abstract_net(mc, ec), ec, np.float32)
    # 6.5 pages of budget at 0.9 of the limit, after 1 MiB already in use.
    limit = int((2**20 + weights + act + 6.5 * page) / 0.9) + 1
    _fake_device(monkeypatch, limit, 2**20)
    s = size_for_compile(mc, ec)
    assert (s.num_pages, s.source) == (6, "device memory")
    assert s.weights_bytes == weights + 2**20 and s.activation_bytes == act
    assert "from the parameter shapes" in s.describe(64)
    # The engine on the same device, weights loaded: bytes_in_use = 1 MiB + its weights
    # (without the XLA cache: the suite's is on, and would keep a page count in its memo).
    _fake_device(monkeypatch, limit, 2**20 + weights)
    monkeypatch.setattr(kv_pages_memo, "cache_directory", lambda: None)
    engine = LLMEngine(MODEL, **ENGINE)
    assert (engine.kv_sizing.num_pages, engine.kv_sizing.activation_bytes) == (6, act)
    # Ample memory: max_num_seqs full sequences.
    _fake_device(monkeypatch, 100 * GIB)
    roomy = size_for_compile(mc, ec)
    assert (roomy.num_pages, roomy.source) == (9, "max_num_seqs")
    _fake_device(monkeypatch, int((weights + act + 3 * page) / 0.9))
    with pytest.raises(ConfigError, match="gpu_memory_utilization 0.9 of .* needs 5"):
        size_for_compile(mc, ec)


def test_cpu_keeps_the_total_unless_ram_is_short(monkeypatch):
    mc = DUMMY_CONFIGS["tiny-llama"]
    ec = engine_config_for(mc, ENGINE)
    page = kv_page_bytes(mc, 16, np.float32)
    weights = weights_device_bytes(abstract_net(mc, ec))
    monkeypatch.setattr(kv_sizing, "device_memory_stats", lambda: None)
    monkeypatch.setattr(kv_sizing, "host_available_bytes", lambda: None)
    assert size_for_compile(mc, ec).num_pages == 9
    monkeypatch.setattr(kv_sizing, "host_available_bytes", lambda: 64 * GIB)
    assert (size_for_compile(mc, ec).num_pages, size_for_compile(mc, ec).source) == (
        9, "max_num_seqs")
    # 7 pages of RAM at 0.9 once the weights are off: host memory decides.
    monkeypatch.setattr(kv_sizing, "host_available_bytes",
                        lambda: weights + int(7.5 * page / 0.9))
    s = size_for_compile(mc, ec)
    assert (s.num_pages, s.source) == (7, "host memory")
    assert size_for_compile(mc, EngineConfig(**ENGINE, num_kv_pages=11)).num_pages == 11


def test_compile_fixes_the_memory_sized_pool_and_the_engine_adopts_it(monkeypatch, tmp_path,
                                                                       capsys):
    mc = DUMMY_CONFIGS["tiny-llama"]
    ec = engine_config_for(mc, ENGINE)
    page = kv_page_bytes(mc, 16, np.float32)
    weights = weights_device_bytes(abstract_net(mc, ec))
    act = profile_activation_bytes(abstract_net(mc, ec), ec, np.float32)
    _fake_device(monkeypatch, int((weights + act + 7.5 * page) / 0.5) + 1)
    d = tmp_path / "cache"
    assert cli.main(["compile", "--model", MODEL, *CLI_ENGINE, "--modes", "logits",
                     "--gpu-memory-utilization", "0.5", "--cache-dir", str(d),
                     "--jobs", "1"]) == 0
    out = capsys.readouterr().out
    assert "KV pool (float32): 7 pages" in out
    assert "KV pool sizing: KV cache (device memory, float32): 6 pages" in out
    manifest = json.loads((d / "manifest.json").read_text())
    assert manifest["fingerprint"]["engine"]["num_kv_pages"] == 7
    assert manifest["fingerprint"]["engine"]["gpu_memory_utilization"] == 0.5
    # Started with the cache (strict: a fingerprint mismatch raises), the engine adopts it.
    engine = LLMEngine(MODEL, compile_cache_dir=str(d), compile_cache_strict=True,
                       gpu_memory_utilization=0.5, **ENGINE)
    assert engine.kv_sizing.num_pages == engine.runner.num_pages == 7
    assert engine.kv_sizing.source == "num_kv_pages"
    assert engine.runner.program_store is not None
    assert len(engine.runner.program_store.entries) == len(manifest["programs"])
