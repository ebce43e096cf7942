"""Benchmark statistics, workload generation, records and option forwarding (no engine)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from jaxinfer.bench import records
from jaxinfer.bench.metrics import RequestTimeline, percentiles, summarize
from jaxinfer.bench.serve import arrival_gaps, engine_argv, sample_lengths


def tl(start, arrivals, tokens, end, expected, prompt=10, error=None) -> RequestTimeline:
    return RequestTimeline(start, prompt, expected, list(arrivals), list(tokens), end, error)


def test_timeline_definitions() -> None:
    t = tl(0.0, [0.1, 0.2, 0.4], [1, 1, 1], 0.4, 3)
    assert t.ttft == pytest.approx(0.1) and t.e2e == pytest.approx(0.4)
    assert t.tpot == pytest.approx(0.15)  # (0.4 - 0.1) / (3 - 1)
    assert t.itls == pytest.approx([0.1, 0.2])
    chunked = tl(0.0, [0.1, 0.3], [1, 3], 0.3, 4)  # 3 tokens in one message
    assert chunked.tpot == pytest.approx(0.2 / 3) and chunked.itls == pytest.approx([0.2])
    assert tl(0.0, [0.1], [1], 0.1, 1).tpot is None  # one token: no TPOT
    assert tl(0.0, [0.1, 0.2], [1, 1], None, 5).tpot is None  # unfinished


def test_summarize_counts_and_rates() -> None:
    runs = [tl(0.0, [0.1, 0.2, 0.4], [1, 1, 1], 0.4, 3),
            tl(0.0, [0.3, 0.5], [1, 1], 0.5, 3),  # finished one token short
            tl(0.1, [], [], None, 3, error="UNAVAILABLE: x"),
            tl(0.2, [0.6], [1], None, 3)]  # aborted at the time limit
    s = summarize(runs, duration_s=2.0)
    assert (s["num_requests"], s["completed"], s["errors"], s["unfinished"]) == (4, 2, 1, 1)
    assert s["length_mismatches"] == 1
    assert s["output_tokens"] == 6 and s["input_tokens"] == 30  # prompts that got a token
    assert s["output_throughput"] == 3.0 and s["request_throughput"] == 1.0
    assert s["total_token_throughput"] == 18.0
    assert s["ttft_ms_p50"] == pytest.approx(200.0)  # median of 100 and 300 ms
    assert s["itl_ms_p99"] == pytest.approx(float(np.percentile([100, 200, 200], 99)))
    assert s["e2e_ms_mean"] == pytest.approx(450.0)
    for m in ("ttft", "tpot", "itl", "e2e"):
        assert s[f"{m}_ms_p50"] <= s[f"{m}_ms_p90"] <= s[f"{m}_ms_p99"]
    with pytest.raises(ValueError, match="duration_s"):
        summarize(runs, 0.0)


def test_percentiles_empty_and_known() -> None:
    assert all(math.isnan(v) for v in percentiles([]).values())
    p = percentiles(range(101))
    assert (p["mean"], p["p50"], p["p90"], p["p99"]) == (50.0, 50.0, 90.0, 99.0)


def test_random_lengths_follow_vllm_range() -> None:
    rng = np.random.default_rng(0)
    assert (sample_lengths(rng, 50, 128, 0.0) == 128).all()
    x = sample_lengths(rng, 5000, 16, 0.5)
    assert x.min() == 8 and x.max() == 24  # integers of [floor(8), ceil(24)]
    assert (sample_lengths(rng, 100, 1, 0.9) >= 1).all()
    with pytest.raises(ValueError, match="range-ratio"):
        sample_lengths(rng, 1, 16, 1.0)
    with pytest.raises(ValueError, match=">= 1"):
        sample_lengths(rng, 1, 0, 0.0)


def test_poisson_gaps() -> None:
    rng = np.random.default_rng(1)
    assert not arrival_gaps(rng, 7, math.inf).any()
    g = arrival_gaps(rng, 20_000, 10.0)
    assert (g >= 0).all() and abs(g.mean() - 0.1) < 0.005
    assert abs(g.std() - 0.1) < 0.005  # exponential: std = mean
    with pytest.raises(ValueError, match="request-rate"):
        arrival_gaps(rng, 1, 0.0)


def test_engine_options_are_forwarded_to_the_server() -> None:
    from jaxinfer.cli import _engine_args, build_parser

    p = build_parser()
    ns = p.parse_args(["bench", "serve", "--model", "dummy:tiny-llama", "--decode-buckets",
                       "4,8", "--max-num-seqs", "8", "--scan-layers", "true", "--dtype",
                       "float32", "--max-model-len", "96", "--compile-cache-dir", "/x",
                       "--strict", "--num-prompts", "3"])
    argv = engine_argv(ns, ns.engine_actions)
    assert "--num-prompts" not in argv  # benchmark options stay here
    server = p.parse_args(["serve", *argv])
    assert _engine_args(server) == _engine_args(ns)
    assert server.model == "dummy:tiny-llama"


def test_write_run_is_strict_json(tmp_path) -> None:
    rec = records.make_record("x.y", float("nan"), "ms", {"a": float("inf"), "b": [1.5]})
    path = records.write_run("bench_x-dummy:m", [rec], tmp_path)
    assert path.parent == tmp_path and ":" not in path.name
    [got] = json.loads(path.read_text())
    assert got["value"] is None and got["config"] == {"a": None, "b": [1.5]}
    assert set(got) == {"name", "value", "unit", "config", "device", "jax", "date", "command"}


def test_format_table_shows_unreported_figures_as_n_a():
    from jaxinfer.bench.metrics import format_table

    text = format_table([("peak device memory (GiB)", None), ("flag", False),
                         ("tokens", 12345), ("ratio", 0.123456), ("nan", float("nan"))], "t")
    values = [line.split()[-1] for line in text.splitlines()[1:]]
    assert values == ["n/a", "False", "12,345", "0.1235", "n/a"], text
