"""The KV page memo (jaxinfer/kv_pages_memo.py): the same pool on every start where JAX's
persistent compilation cache keeps the programs, despite free memory that moves a little."""

from __future__ import annotations

import json

import pytest

from jaxinfer import kv_pages_memo, kv_sizing
from jaxinfer.kv_pages_memo import (
    ADOPT_WITHIN,
    KEEP,
    MEMO_FILE,
    SLACK,
    choose_pages,
    local_directory,
    read_records,
    remember,
    write_records,
)


def test_choose_pages_adopts_a_close_record_that_fits():
    # The H100's 8B FP8 starts (module docstring): 45,529 then 45,601 pages fit.
    first, adopted = choose_pages({}, "k", 45_529, need=257)
    assert not adopted and first == 45_529 - int(45_529 * SLACK) == 45_302
    for fit in (45_601, 45_529, 45_400):  # the next starts, more or less room: the same pool
        assert choose_pages({"k": first}, "k", fit, need=257) == (first, True)
    # The record no longer fits: sized afresh (and the caller records the new count).
    assert choose_pages({"k": first}, "k", 45_300, need=257) == (45_300 - 226, False)
    # Much more room now (over ADOPT_WITHIN): sized afresh rather than kept small.
    roomy = int(first / (1 - ADOPT_WITHIN)) + 10
    assert choose_pages({"k": first}, "k", roomy, need=257)[1] is False
    # Other keys, and records that are not counts, are not used.
    assert choose_pages({"other": first}, "k", 45_529, need=257)[1] is False
    for bad in (True, "45302", 45_302.0, None, [45_302.0], {"a": 45_302}):
        assert choose_pages({"k": bad}, "k", 45_529, need=257) == (45_302, False)


def test_several_counts_a_key_each_engine_finds_its_own():
    """Two engines in one process: the second sees the first's pool in use, so fits far
    fewer pages; both counts are kept and each start adopts the one near its own fit."""
    records: dict = {}
    remember(records, "k", 45_302)
    remember(records, "k", 2_000)
    assert records["k"] == [45_302, 2_000]
    assert choose_pages(records, "k", 45_529, need=257) == (45_302, True)
    assert choose_pages(records, "k", 2_010, need=257) == (2_000, True)
    remember(records, "k", 45_302)  # known again: moved to the end, not doubled
    assert records["k"] == [2_000, 45_302]
    for n in range(20):
        remember(records, "k", 10_000 + n)
    assert records["k"] == list(range(10_020 - KEEP, 10_020))  # the latest KEEP
    records["k"] = [45_100, 45_302, "x"]  # the largest that fits wins
    assert choose_pages(records, "k", 45_400, need=257) == (45_302, True)
    # a memo written with one int per key (before lists) is read too
    assert choose_pages({"old": 45_302}, "old", 45_400, need=257) == (45_302, True)


def test_the_memo_is_kept_only_in_a_local_cache_that_is_on():
    import jax

    assert local_directory("/c/xla") == "/c/xla"
    assert local_directory("gs://bucket/xla") is None  # not a local path
    assert local_directory(None) is None and local_directory("") is None
    suite = jax.config.jax_compilation_cache_dir  # the suite's cache (conftest): on
    assert kv_pages_memo.cache_directory() == suite
    enabled = jax.config.jax_enable_compilation_cache
    try:  # --xla-cache-dir off with a directory left set: off
        jax.config.update("jax_enable_compilation_cache", False)
        assert kv_pages_memo.cache_directory() is None
    finally:
        jax.config.update("jax_enable_compilation_cache", enabled)


def test_choose_pages_never_goes_below_one_sequence_nor_above_the_fit():
    assert choose_pages({}, "k", 300, need=299) == (299, False)  # the slack stops at need
    assert choose_pages({}, "k", 100, need=5) == (100, False)  # int(100 * SLACK) == 0
    assert choose_pages({"k": 4}, "k", 5, need=5) == (5, False)  # a record below need
    assert choose_pages({"k": 6}, "k", 5, need=5) == (5, False)  # a record above the fit


def test_records_round_trip_and_damage_costs_nothing(tmp_path):
    path = tmp_path / "sub" / MEMO_FILE  # the directory is made
    write_records(path, {"a": 10})
    assert read_records(path) == {"a": 10}
    for damaged in ("{not json", "[1, 2]", ""):
        path.write_text(damaged)
        assert read_records(path) == {}
    assert read_records(tmp_path / "missing.json") == {}
    blocker = tmp_path / "file"
    blocker.write_text("")
    write_records(blocker / MEMO_FILE, {"a": 1})  # cannot be written: logged, not raised


def test_a_failed_write_leaves_the_memo_and_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / MEMO_FILE
    write_records(path, {"a": [1]})

    def fail(*_):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(kv_pages_memo.os, "replace", fail)
    write_records(path, {"a": [2]})  # logged, not raised
    assert read_records(path) == {"a": [1]}
    assert sorted(p.name for p in tmp_path.iterdir()) == [MEMO_FILE]


@pytest.mark.parametrize("cache_on", [True, False])
def test_engines_on_a_device_keep_the_first_starts_pool(tmp_path, monkeypatch, cache_on):
    """Two engines whose device has a little more, then a little less, room than the first
    (faked memory_stats, as tests/engine/test_compile_kv.py): with the XLA cache on they hold
    the first start's pool; with it off each sizes its own, exactly as before."""
    from jaxinfer.engine import LLMEngine
    from jaxinfer.kv_sizing import kv_page_bytes
    from jaxinfer.loading import DUMMY_CONFIGS

    args = {"max_model_len": 64, "block_size": 16, "max_num_seqs": 2,
            "max_num_batched_tokens": 16, "max_prefill_seqs": 2}
    monkeypatch.setattr(kv_pages_memo, "cache_directory",
                        lambda: str(tmp_path) if cache_on else None)
    page = kv_page_bytes(DUMMY_CONFIGS["tiny-llama"], 16, "float32")
    # ~2,000 pages of room (16 MiB; the slack then leaves 10), after 256 MiB in use
    pools, limit = [], int((2**28 + 2000 * page) / 0.9)
    for extra_pages in (0, -3, 2):  # bytes_in_use moves by a few pages between starts
        def stats(extra=extra_pages):
            return {"bytes_limit": limit, "bytes_in_use": 2**28 + extra * page}

        monkeypatch.setattr(kv_sizing, "device_memory_stats", stats)
        engine = LLMEngine("dummy:tiny-llama", **args)
        s = engine.kv_sizing
        assert s.source == "device memory" and engine.runner.num_pages == s.num_pages
        pools.append(s.num_pages)
        fits = int(0.9 * limit - 2**28 - extra_pages * page - s.activation_bytes
                   - kv_sizing.slot_state_bytes(engine.model_config, engine.config)) // page
        if cache_on:
            assert s.num_pages <= fits and ("as an earlier start" in s.note) == bool(
                extra_pages)
        else:
            assert s.num_pages == fits and not s.note
    if cache_on:
        assert pools[0] == pools[1] == pools[2] and pools[0] > 1000
        memo = json.loads((tmp_path / MEMO_FILE).read_text())
        assert list(memo.values()) == [[pools[0]]]
    else:
        assert pools[1] == pools[0] + 3 and pools[2] == pools[0] - 2
        assert not (tmp_path / MEMO_FILE).exists()
