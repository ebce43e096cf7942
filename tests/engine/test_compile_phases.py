"""`jaxinfer compile` start-up and exit: the phase log, the worker pool started first and
stopped at once, and the fingerprint every worker must match (issue #5)."""

from __future__ import annotations

import json
import logging
import re
import time

import pytest

from jaxinfer import cli
from jaxinfer.compile import (
    CompilePool,
    PhaseLog,
    _worker_compile,
    _worker_setup,
    enumerate_programs,
    process_start_time,
)
from jaxinfer.compile_cache import CompileCacheError
from jaxinfer.config import EngineConfig
from jaxinfer.loading import DUMMY_CONFIGS

MODEL = "dummy:tiny-llama"
ENGINE = {"max_model_len": 64, "block_size": 16, "max_num_seqs": 2,
          "max_num_batched_tokens": 16, "max_prefill_seqs": 2}
CLI_ENGINE = ["--max-model-len", "64", "--block-size", "16", "--max-num-seqs", "2",
              "--max-num-batched-tokens", "16", "--max-prefill-seqs", "2"]


def _phases(caplog) -> dict[str, float]:
    out = {}
    for r in caplog.records:
        m = re.fullmatch(r"phase (.+): (-?[\d.]+) s", r.getMessage())
        if m and r.name == "jaxinfer.compile":
            out[m.group(1)] = float(m.group(2))
    return out


def test_process_start_is_before_now_and_after_boot():
    start = process_start_time()
    assert start <= time.time()
    assert time.time() - start < 24 * 3600  # a test process, not the machine's boot
    ph = PhaseLog()
    ph.mark("a")
    ph.mark("b", at=ph.t0 + 1.5)
    assert list(ph.marks) == ["a", "b"] and ph.marks["b"] == pytest.approx(1.5)


def test_list_logs_its_phases_in_order_and_starts_no_worker(caplog):
    caplog.set_level(logging.INFO, logger="jaxinfer.compile")
    assert cli.main(["compile", "--model", MODEL, *CLI_ENGINE, "--list", "--jobs", "2"]) == 0
    ph = _phases(caplog)
    assert list(ph) == ["command parsed", "model config", "KV pool sized",
                        "configuration described"]
    assert 0 < ph["command parsed"] <= ph["model config"] <= ph["KV pool sized"] <= ph[
        "configuration described"]


def test_pool_starts_workers_at_once_and_only_those_needed():
    """The pool spawns ``start`` workers when made (not one per submitted compile), setup()
    the rest its programs need (2 of 3 jobs here); each worker reports its import and set-up
    times, and close() leaves no process behind."""
    pool = CompilePool(3, start=1)
    try:
        assert len(pool.pool._processes) == 1  # before any configuration is known
        fp = pool.setup(DUMMY_CONFIGS["tiny-llama"], EngineConfig(**ENGINE), n=2)
        procs = list(pool.pool._processes.values())
        assert len(procs) == 2  # two programs' worth, not the 3 jobs
        assert fp["engine"]["block_size"] == 16
        marks = pool.phases.marks
        assert {"workers started: 1", "workers started: 2", "first worker imported",
                "last worker imported", "first worker ready", "last worker ready"} <= set(marks)
        assert marks["workers started: 1"] <= marks["first worker imported"]
        assert marks["first worker imported"] <= marks["last worker ready"]
    finally:
        pool.close()
    # killed; the executor's own thread may reap them a moment after close() returns
    deadline = time.time() + 10
    while any(p.exitcode is None for p in procs) and time.time() < deadline:
        time.sleep(0.05)
    assert all(p.exitcode is not None for p in procs)
    pool.close()  # again: nothing happens


def test_worker_refuses_a_fingerprint_it_does_not_match():
    """A worker compiles only for the fingerprint the manifest records: one of another
    configuration is refused before any compile."""
    mc, ec = DUMMY_CONFIGS["tiny-llama"], EngineConfig(**ENGINE)
    _, _, fp = _worker_setup(mc, ec)
    other = json.loads(json.dumps(fp))
    other["engine"]["block_size"] = 8
    with pytest.raises(CompileCacheError, match="engine.block_size: 8 -> 16"):
        _worker_compile(mc, ec, other, enumerate_programs(ec)[0])


@pytest.mark.slow
def test_parallel_compile_logs_phases_in_order(tmp_path, caplog):
    """--jobs 2: the pool starts before the configuration is read, workers are ready before
    the first compile is submitted, and they are stopped once the manifest is written."""
    caplog.set_level(logging.INFO, logger="jaxinfer.compile")
    d = tmp_path / "c"
    assert cli.main(["compile", "--model", MODEL, *CLI_ENGINE, "--modes", "logits",
                     "--cache-dir", str(d), "--jobs", "2"]) == 0
    ph = _phases(caplog)
    started = [k for k in ph if k.startswith("workers started: ")]
    assert list(ph)[:2] == ["command parsed", started[0]]  # before the configuration is read
    assert ph[started[0]] <= ph["model config"]
    assert ph["last worker ready"] <= ph["compiles submitted"] <= ph["first compile done"]
    assert (ph["last compile done, manifest written"] <= ph["workers stopped"] <= ph["done"])
    manifest = json.loads((d / "manifest.json").read_text())
    assert [p["mode"] for p in manifest["programs"]] == ["logits"]
