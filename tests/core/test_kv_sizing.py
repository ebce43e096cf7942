"""KV pool sizing: arithmetic against given memory numbers (the GPU path runs on the CPU with
a fake ``memory_stats`` dict), the CPU path, the start-up log line, errors."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from jaxinfer.config import ConfigError, EngineConfig
from jaxinfer.kv_sizing import (
    host_available_bytes,
    kv_page_bytes,
    size_kv_pool,
    slot_state_bytes,
)
from tests.conftest import tiny_config

GIB = 2**30


def test_page_bytes() -> None:
    cfg = tiny_config()  # 3 layers, 2 KV heads, head_dim 8
    assert kv_page_bytes(cfg, 16, np.float32) == 2 * 3 * 2 * 16 * 8 * 4
    assert kv_page_bytes(cfg, 16, np.float16) == 2 * 3 * 2 * 16 * 8 * 2


def test_device_memory_sizing() -> None:
    cfg = tiny_config(num_layers=32, num_kv_heads=8, head_dim=128, num_heads=32)
    ec = EngineConfig(max_model_len=4096, block_size=16, gpu_memory_utilization=0.9)
    page = kv_page_bytes(cfg, 16, np.float16)  # 2 MiB: the Llama-3-8B page in bf16
    assert page == 2 * 2**20
    stats = {"bytes_limit": 100 * GIB, "bytes_in_use": 16 * GIB}
    s = size_kv_pool(cfg, ec, np.float16, memory_stats=stats, activation_bytes=4 * GIB)
    slots = slot_state_bytes(cfg, ec)  # the penalty counts, int32 [max_num_seqs + 1, vocab]
    assert slots == (8 + 1) * 96 * 4
    budget = int(0.9 * 100 * GIB) - 16 * GIB - 4 * GIB - slots
    assert s.source == "device memory" and s.budget_bytes == budget
    assert s.num_pages == budget // page and s.pool_bytes <= budget
    assert s.max_tokens == (s.num_pages - 1) * 16
    assert f"{s.num_pages - 1} pages x 16 tokens (+ the null page) = {s.max_tokens} tokens" in s.describe(4096)
    more = size_kv_pool(cfg, ec, np.float16, memory_stats=stats, activation_bytes=0)
    assert more.num_pages == (budget + 4 * GIB) // page  # activations come off the budget
    with pytest.raises(ConfigError, match="gpu_memory_utilization 0.9 .* needs 257"):
        size_kv_pool(cfg, ec, np.float16,
                     memory_stats={"bytes_limit": 20 * GIB, "bytes_in_use": int(17.6 * GIB)})


def test_a_full_device_names_other_engines_not_only_max_num_seqs() -> None:
    """A second engine sized from device memory in one process finds the first one's pool
    in use: the error says so (it used to say only "lower max_num_seqs", which no value of
    max_num_seqs would fix; seen on an H100 running the tests with several engines)."""
    cfg, ec = tiny_config(), EngineConfig(max_model_len=64, block_size=16)
    full = {"bytes_limit": 80 * GIB, "bytes_in_use": 72 * GIB}  # 0.9 x 80 GiB in use
    with pytest.raises(ConfigError, match=r"more than the 0\.00 GiB of device memory \(0\.9 "
                                          r"of the limit less what is in use: the weights, and "
                                          r"the KV pool of any other engine alive in this "
                                          r"process\); lower max_num_seqs, or free that memory "
                                          r".*give several engines of one process num_kv_pages"):
        size_kv_pool(cfg, ec, np.float16, memory_stats=full, activation_bytes=0)


def test_explicit_pages_and_cpu_paths() -> None:
    cfg = tiny_config()
    ec = EngineConfig(max_model_len=64, block_size=4, max_num_seqs=8)
    page = kv_page_bytes(cfg, 4, np.float32)
    fixed = size_kv_pool(cfg, EngineConfig(max_model_len=64, block_size=4, num_kv_pages=40),
                         np.float32, memory_stats={"bytes_limit": 10**12, "bytes_in_use": 0})
    assert (fixed.num_pages, fixed.source) == (40, "num_kv_pages")
    roomy = size_kv_pool(cfg, ec, np.float32, memory_stats=None, host_bytes=GIB)
    assert (roomy.num_pages, roomy.source) == (ec.total_kv_pages, "max_num_seqs") == (129,
                                                                                   "max_num_seqs")
    tight = size_kv_pool(cfg, ec, np.float32, memory_stats=None, host_bytes=50 * page)
    assert tight.source == "host memory"
    assert tight.num_pages == (int(0.9 * 50 * page) - slot_state_bytes(cfg, ec)) // page
    with pytest.raises(ConfigError, match="available RAM"):
        size_kv_pool(cfg, ec, np.float32, memory_stats=None, host_bytes=10 * page)
    unknown = size_kv_pool(cfg, ec, np.float32, memory_stats=None, host_bytes=None)
    assert unknown.num_pages == 129
    avail = host_available_bytes()
    assert avail is None or avail > 0


def test_fp8_kv_doubles_the_pages_of_bf16() -> None:
    import ml_dtypes

    cfg = tiny_config(num_layers=32, num_kv_heads=8, head_dim=128, num_heads=32,
                      vocab_size=128256)  # 8B shape
    stats = {"bytes_limit": 100 * GIB, "bytes_in_use": 16 * GIB}
    sized = {}
    for kv in ("auto", "fp8", "fp8_e4m3"):
        ec = EngineConfig(max_model_len=4096, block_size=16, kv_cache_dtype=kv)
        sized[kv] = size_kv_pool(cfg, ec, ml_dtypes.bfloat16, memory_stats=stats,
                                 activation_bytes=4 * GIB)
    bf16, fp8 = sized["auto"], sized["fp8"]
    assert (bf16.kv_dtype, fp8.kv_dtype, sized["fp8_e4m3"].kv_dtype) == (
        "bfloat16", "float8_e4m3fn", "float8_e4m3fn")
    assert fp8.page_bytes == bf16.page_bytes // 2 == 2**20  # 1 byte per element
    assert (bf16.scale_bytes, fp8.scale_bytes) == (0, 2 * 32 * 4)  # k and v scale per layer
    budget = int(0.9 * 100 * GIB) - 16 * GIB - 4 * GIB - 9 * 128256 * 4  # - penalty counts
    assert fp8.num_pages == (budget - fp8.scale_bytes) // 2**20 == 71675
    assert bf16.num_pages == budget // 2**21 == 35837
    assert fp8.max_tokens >= 2 * bf16.max_tokens - 16  # twice the tokens, to a page
    assert fp8.pool_bytes <= budget
    line = fp8.describe(4096)
    assert "float8_e4m3fn" in line and f"= {fp8.max_tokens} tokens" in line
    # Explicit page counts keep their number of pages, at half the bytes.
    ec = EngineConfig(max_model_len=4096, num_kv_pages=100, kv_cache_dtype="fp8")
    fixed = size_kv_pool(cfg, ec, ml_dtypes.bfloat16, memory_stats=None)
    assert fixed.num_pages == 100 and fixed.pool_bytes == 100 * 2**20 + 256


def test_max_num_seqs_whose_state_exceeds_memory_is_refused_naming_it() -> None:
    """``--max-num-seqs 10000000`` used to end in an out-of-memory kill (exit 137) when the
    runner allocated its int32 [max_num_seqs + 1, vocab] penalty counts; the pool's budget
    now leaves room for them, and a max_num_seqs they alone overflow is a ConfigError."""
    cfg = tiny_config(vocab_size=128256)
    ec = EngineConfig(max_model_len=64, max_num_seqs=10**6)  # 477.79 GiB of counts
    msg = (r"max_num_seqs 1000000: the per-sequence penalty counts \(int32 \[1000001, "
           r"128256\]\) need 477\.79 GiB, more than the [\d.]+ GiB of ")
    with pytest.raises(ConfigError, match=msg + "device memory") as err:
        size_kv_pool(cfg, ec, np.float32, memory_stats={"bytes_limit": 140 * GIB,
                                                        "bytes_in_use": 16 * GIB})
    assert err.value.field == "max_num_seqs"
    with pytest.raises(ConfigError, match=msg + "available RAM"):
        size_kv_pool(cfg, ec, np.float32, memory_stats=None, host_bytes=24 * GIB)
    ok = EngineConfig(max_model_len=64, max_num_seqs=256)  # 125 MiB of counts: fits
    assert size_kv_pool(cfg, ok, np.float32, memory_stats=None, host_bytes=24 * GIB).source \
        == "max_num_seqs"


def test_cli_huge_max_num_seqs_is_one_line_error(capsys, monkeypatch) -> None:
    from jaxinfer import kv_sizing
    from jaxinfer.cli import main

    # 1 GiB "available": the 10**6 rows of dummy:tiny-llama's 256-token vocabulary (0.95 GiB)
    # overflow 0.9 of it, and would fit the real machine were the check to let them through.
    monkeypatch.setattr(kv_sizing, "host_available_bytes", lambda: GIB)
    assert main(["generate", "--model", "dummy:tiny-llama", "--token-ids", "--max-num-seqs",
                 str(10**6), "--max-model-len", "64", "1 2 3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        "jaxinfer: error: max_num_seqs 1000000: the per-sequence penalty counts (int32 "
        "[1000001, 256]) need 0.95 GiB, more than the 0.90 GiB"), err
    assert err[0].endswith("GiB of available RAM (0.9 of it); lower max_num_seqs"), err


@pytest.mark.parametrize("u", [0, 1.5, -0.1, True])
def test_bad_utilization(u) -> None:
    with pytest.raises(ConfigError, match="gpu_memory_utilization"):
        EngineConfig(gpu_memory_utilization=u)


@pytest.mark.parametrize("kw", [{"max_queue_len": 0}, {"max_consecutive_prefills": -1}])
def test_bad_scheduler_limits(kw) -> None:
    with pytest.raises(ConfigError, match=next(iter(kw))):
        EngineConfig(**kw)


def test_engine_logs_pool_at_start(caplog) -> None:
    from jaxinfer.engine import LLMEngine
    from tests.conftest import tiny_loaded

    with caplog.at_level(logging.INFO, logger="jaxinfer.engine"):
        eng = LLMEngine(tiny_loaded(), max_model_len=64, block_size=4, max_num_seqs=2,
                        max_queue_len=3, max_consecutive_prefills=2,
                        enable_prefix_caching=False)
    s = eng.kv_sizing
    assert s.num_pages == eng.runner.num_pages == eng.scheduler.cfg.num_pages == 33
    assert eng.runner.kv_cache_bytes() == s.pool_bytes
    line = next(r.getMessage() for r in caplog.records if "KV cache" in r.getMessage())
    assert "32 pages x 4 tokens (+ the null page) = 128 tokens" in line and "max concurrency" in line
    assert "float32" in line  # the KV dtype ("auto": the model's)
    sc = eng.scheduler.cfg
    assert (sc.max_queue_len, sc.max_consecutive_prefills, sc.enable_prefix_caching) == (
        3, 2, False)


def test_engine_fp8_pool_bytes_and_log(caplog) -> None:
    from jaxinfer.engine import LLMEngine
    from tests.conftest import tiny_loaded

    with caplog.at_level(logging.INFO, logger="jaxinfer.engine"):
        eng = LLMEngine(tiny_loaded(), max_model_len=64, block_size=4, max_num_seqs=2,
                        kv_cache_dtype="fp8")
    s = eng.kv_sizing
    assert eng.runner.cache.dtype == np.dtype("float8_e4m3fn")
    assert eng.runner.kv_cache_bytes() == s.pool_bytes == 33 * 2 * 3 * 2 * 4 * 8 + 2 * 3 * 4
    line = next(r.getMessage() for r in caplog.records if "KV cache" in r.getMessage())
    assert "float8_e4m3fn): 32 pages x 4 tokens (+ the null page) = 128 tokens" in line
