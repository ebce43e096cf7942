"""Smoke tests of ``jaxinfer bench offline | latency | serve`` on a tiny random model (CPU).

No timing is asserted; the structure is: every request finished, no errors, token counts
equal the lengths asked for, percentiles ordered, records written with the common fields.
All three use one engine configuration (one prefill and one decode program, shared through
JAX's persistent compilation cache set up in tests/conftest.py), so the set stays short.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import pytest

from jaxinfer.cli import main

ROOT = Path(__file__).resolve().parents[2]
# max_prefill_seqs 1: every prefill step is one prompt (T 64, S 1), so the workloads below
# need exactly one prefill and one decode program.
TINY = ["--model", "dummy:tiny-llama", "--max-model-len", "64", "--block-size", "16",
        "--decode-buckets", "4", "--prefill-buckets", "64", "--max-num-batched-tokens", "64",
        "--max-prefill-seqs", "1", "--page-buckets", "4"]
FIELDS = {"name", "value", "unit", "config", "device", "jax", "date", "command"}


def load_records(out: Path, prefix: str) -> dict[str, dict]:
    [path] = out.glob(f"{prefix}-*.json")
    recs = json.loads(path.read_text())
    assert all(set(r) == FIELDS for r in recs)
    return {r["name"]: r for r in recs}


def values(recs: dict[str, dict], prefix: str) -> dict[str, object]:
    return {k.removeprefix(prefix): r["value"] for k, r in recs.items() if k.startswith(prefix)}


def assert_ordered(v: dict[str, object], metrics=("ttft", "tpot", "itl", "e2e")) -> None:
    for m in metrics:
        p50, p90, p99 = (v[f"{m}_ms_p{q}"] for q in (50, 90, 99))
        assert 0 <= p50 <= p90 <= p99, (m, p50, p90, p99)


def test_bench_offline(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["bench", "offline", *TINY, "--max-num-seqs", "4", "--input-len", "16",
               "--output-len", "8", "--num-prompts", "10", "--out", str(tmp_path)])
    assert rc == 0
    recs = load_records(tmp_path, "bench_offline-dummy-tiny-llama-16x8")
    v = values(recs, "bench_offline.")
    assert (v["num_requests"], v["completed"], v["errors"], v["unfinished"]) == (10, 10, 0, 0)
    assert v["length_mismatches"] == 0
    assert v["input_tokens"] == 10 * 16 and v["output_tokens"] == 10 * 8
    assert_ordered(v)
    # Waves of 4, 4 and 2 requests: the warm-up compiled every program the run needed.
    # (built by XLA or taken from JAX's persistent cache, which counts as "loaded")
    assert v["warmup_programs_compiled"] + v["warmup_programs_loaded"] >= 2
    assert v["run_programs_compiled"] == 0 and v["run_programs_loaded"] == 0
    assert v["kv_pages"] == 4 * 4 and v["kv_tokens"] == 16 * 16  # max_num_seqs x 64 tokens
    assert (v["peak_running"], v["preemptions"]) == (4, 0)  # the pool holds 4 at full length
    # The engine start's phases (issue #5 reports the warm start without the weights).
    phases = [v[f"start_{k}_s"] for k in ("read_weights", "weights_to_device", "kv_pool",
                                          "compile_cache_open")]
    assert all(p >= 0 for p in phases) and sum(phases) <= v["load_s"]
    assert v["output_throughput"] > 0 and v["peak_host_rss_bytes"] > 0
    cfg = recs["bench_offline.output_throughput"]["config"]
    assert (cfg["input_len"], cfg["output_len"], cfg["num_prompts"]) == (16, 8, 10)
    assert recs["bench_offline.output_throughput"]["unit"] == "tok/s"
    out = capsys.readouterr().out
    assert "requests completed / submitted             10 / 10" in out  # the summary table


def test_bench_offline_reports_preemptions_of_a_small_pool(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]
                                                           ) -> None:
    # 6 usable pages of 16 tokens; 4 running requests of 16 + 40 tokens need 4 pages each
    # at the end: the pool admits them (2 pages each for the prompt and first tokens) and
    # must preempt as they grow. Outputs stay complete (recompute preemption).
    rc = main(["bench", "offline", *TINY, "--max-num-seqs", "4", "--num-kv-pages", "7",
               "--input-len", "16", "--output-len", "40", "--num-prompts", "4",
               "--out", str(tmp_path)])
    assert rc == 0
    v = values(load_records(tmp_path, "bench_offline-dummy-tiny-llama-16x40"), "bench_offline.")
    assert (v["completed"], v["errors"], v["length_mismatches"]) == (4, 0, 0)
    assert v["preemptions"] >= 1 and 1 <= v["peak_running"] <= 4
    row = f"running sequences peak, preemptions +{v['peak_running']}, {v['preemptions']}\n"
    assert re.search(row, capsys.readouterr().out)  # the summary table's row


def test_bench_offline_peak_counts_sequences_that_finish_in_their_step(tmp_path: Path) -> None:
    # helper-56: one output token each, so every sequence finishes in the step that ran it
    # and none is running after any step; the peak still counts them (was 0).
    rc = main(["bench", "offline", *TINY, "--max-num-seqs", "4", "--input-len", "16",
               "--output-len", "1", "--num-prompts", "4", "--out", str(tmp_path)])
    assert rc == 0
    v = values(load_records(tmp_path, "bench_offline-dummy-tiny-llama-16x1"), "bench_offline.")
    assert v["completed"] == 4 and 1 <= v["peak_running"] <= 4 and v["preemptions"] == 0


def test_bench_offline_several_workloads_share_one_engine(tmp_path: Path) -> None:
    # 16/8 then 32/8 (--output-len given once): one engine start, one record file and one
    # warm-up each, every request of both finished with the lengths asked for.
    rc = main(["bench", "offline", *TINY, "--max-num-seqs", "4", "--input-len", "16,32",
               "--output-len", "8", "--num-prompts", "6,3", "--out", str(tmp_path)])
    assert rc == 0
    first = values(load_records(tmp_path, "bench_offline-dummy-tiny-llama-16x8"), "bench_offline.")
    second = values(load_records(tmp_path, "bench_offline-dummy-tiny-llama-32x8"), "bench_offline.")
    assert (first["completed"], first["input_tokens"], first["output_tokens"]) == (6, 96, 48)
    assert (second["completed"], second["input_tokens"], second["output_tokens"]) == (3, 96, 24)
    assert first["load_s"] == second["load_s"]  # the same engine start, reported in both
    assert first["run_programs_compiled"] == second["run_programs_compiled"] == 0


def test_bench_offline_multi_step_warm_up_builds_the_k_step_programs(tmp_path: Path) -> None:
    """With --num-scheduler-steps k > 1 the warm-up builds the k-step decode programs the
    run's windows use (their compile time was also missing from the counters)."""
    rc = main(["bench", "offline", *TINY, "--max-num-seqs", "4", "--input-len", "16",
               "--output-len", "8", "--num-prompts", "4", "--num-scheduler-steps", "2",
               "--out", str(tmp_path)])
    assert rc == 0
    v = values(load_records(tmp_path, "bench_offline-dummy-tiny-llama-16x8"), "bench_offline.")
    assert (v["completed"], v["output_tokens"], v["errors"]) == (4, 32, 0)
    assert v["run_programs_compiled"] == 0 and v["run_programs_loaded"] == 0
    assert v["run_compile_s"] == 0.0
    cfg = load_records(tmp_path, "bench_offline-dummy-tiny-llama-16x8")[
        "bench_offline.output_throughput"]["config"]  # the record says how it decoded
    assert (cfg["num_scheduler_steps"], cfg["async_scheduling"]) == (2, True)


def test_bench_offline_samples_with_top_p_top_k_min_p(tmp_path: Path) -> None:
    """--temperature / --top-p / --top-k / --min-p reach every request (vLLM bench serve's
    names) and the records' config."""
    rc = main(["bench", "offline", *TINY, "--max-num-seqs", "4", "--input-len", "16",
               "--output-len", "6", "--num-prompts", "4", "--temperature", "0.7",
               "--top-p", "0.9", "--top-k", "20", "--min-p", "0.05", "--out", str(tmp_path)])
    assert rc == 0
    recs = load_records(tmp_path, "bench_offline-dummy-tiny-llama-16x6")
    v = values(recs, "bench_offline.")
    assert (v["completed"], v["output_tokens"], v["errors"]) == (4, 24, 0)
    cfg = recs["bench_offline.output_throughput"]["config"]
    assert (cfg["temperature"], cfg["top_p"], cfg["top_k"], cfg["min_p"]) == (0.7, 0.9, 20, 0.05)
    from jaxinfer.bench import driver

    sp = driver.fixed_length_params(6, 0.7, 0.9, 20, 0.05)
    assert (sp.temperature, sp.top_p, sp.top_k, sp.min_p, sp.max_tokens, sp.ignore_eos) == (
        0.7, 0.9, 20, 0.05, 6, True)


def test_bench_offline_time_limit_reports_what_finished(tmp_path: Path) -> None:
    rc = main(["bench", "offline", *TINY, "--max-num-seqs", "4", "--input-len", "16",
               "--output-len", "40", "--num-prompts", "12", "--time-limit", "0",
               "--no-warmup", "--out", str(tmp_path)])
    assert rc == 0
    v = values(load_records(tmp_path, "bench_offline"), "bench_offline.")
    assert v["num_requests"] == 12 and v["completed"] + v["unfinished"] == 12
    assert v["unfinished"] >= 8  # one step ran: the first wave at most has started
    assert v["errors"] == 0


def test_bench_latency(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["bench", "latency", *TINY, "--prompt-lens", "16,40", "--repeats", "2",
               "--concurrency", "1,4", "--input-len", "16", "--output-len", "8",
               "--out", str(tmp_path)])
    assert rc == 0
    recs = load_records(tmp_path, "bench_latency-dummy-tiny-llama")
    for L in (16, 40):
        r = recs[f"bench_latency.ttft_ms_p50.prompt{L}"]
        assert r["value"] > 0 and r["config"]["prompt_len"] == L
        assert r["config"]["ttft_ms_min"] <= r["value"] <= r["config"]["ttft_ms_max"]
    for c in (1, 4):
        conf = recs[f"bench_latency.output_throughput.c{c}"]["config"]
        assert conf["concurrency"] == c and conf["completed"] == c and conf["errors"] == 0
        assert recs[f"bench_latency.output_throughput.c{c}"]["value"] > 0
        assert 0 < recs[f"bench_latency.tpot_ms_p50.c{c}"]["value"] \
            <= recs[f"bench_latency.tpot_ms_p99.c{c}"]["value"]
        assert recs[f"bench_latency.itl_ms_p50.c{c}"]["value"] \
            <= recs[f"bench_latency.itl_ms_p99.c{c}"]["value"]
        assert recs[f"bench_latency.bandwidth_frac.c{c}"]["value"] > 0  # ceilings measured
        assert conf["copy_bytes_per_s"] > 0 and conf["roofline_context"] == 16 + 4
    out = capsys.readouterr().out
    assert "TTFT 40-token prompt" in out and "4 streams" in out


def test_bench_serve_starts_a_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The server subprocess shares the suite's compiled programs (tests/conftest.py).
    import jax

    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", jax.config.jax_compilation_cache_dir)
    monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # bench serve sets it here
    n, seed = 12, 3
    rc = main(["bench", "serve", *TINY, "--max-num-seqs", "4", "--num-prompts", str(n),
               "--random-input-len", "16", "--random-output-len", "8",
               "--random-range-ratio", "0.5", "--request-rate", "100", "--max-concurrency",
               "3", "--num-warmups", "2", "--seed", str(seed), "--out", str(tmp_path)])
    assert rc == 0
    v = values(load_records(tmp_path, "bench_serve-dummy-tiny-llama"), "bench_serve.")
    assert (v["num_requests"], v["completed"], v["errors"], v["not_sent"]) == (n, n, 0, 0)
    assert v["length_mismatches"] == 0 and v["server_exit_code"] == 0
    # The lengths drawn by the benchmark (same seed, same order): every token arrived.
    from jaxinfer.bench.serve import sample_lengths

    rng = np.random.default_rng(seed)
    ins = sample_lengths(rng, n + 2, 16, 0.5)
    outs = sample_lengths(rng, n + 2, 8, 0.5)
    assert v["input_tokens"] == int(ins[:n].sum()) and v["output_tokens"] == int(outs[:n].sum())
    assert_ordered(v)
    assert v["compilations_during_run"] >= 0


def test_bad_options_are_one_line_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "offline", *TINY, "--input-len", "0"]) == 2
    assert "jaxinfer: error: --input-len must be >= 1" in capsys.readouterr().err
    assert main(["bench", "offline", *TINY, "--input-len", "16,32", "--num-prompts", "1,2,3"]) == 2
    assert "--input-len has 2 values; give 1 or 3 (one per workload)" in capsys.readouterr().err
    assert main(["bench", "offline", *TINY, "--top-p", "1.5"]) == 2  # before the engine starts
    assert "top_p must be in (0, 1], got 1.5" in capsys.readouterr().err
    assert main(["bench", "latency", *TINY, "--top-k", "-2"]) == 2
    assert "top_k" in capsys.readouterr().err
    assert main(["bench", "serve", *TINY, "--random-range-ratio", "1.5"]) == 2
    assert "--random-range-ratio must be in [0, 1)" in capsys.readouterr().err
    for argv, needle in [
        (["bench", "offline", *TINY, "--input-len", "16,,32"], "argument --input-len: expected "
         "comma-separated integers, got '16,,32': item 2 is empty"),
        (["bench", "offline", *TINY, "--num-prompts", "4,"], "argument --num-prompts: expected "
         "comma-separated integers, got '4,': item 2 is empty"),
        (["bench", "latency", *TINY, "--prompt-lens", ",16"], "item 1 is empty"),
        (["generate", "--decode-buckets", "1,x"], "argument --decode-buckets: expected "
         "comma-separated integers, got '1,x': item 2 ('x') is not an integer"),
    ]:
        with pytest.raises(SystemExit) as e:  # argparse: usage and one error line
            main(argv)
        assert e.value.code == 2 and needle in capsys.readouterr().err, argv
    assert os.environ.get("JAX_PLATFORMS") == "cpu"


def test_options_checked_before_any_work(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Lengths, concurrency, --out and server reachability fail as one line before an
    engine starts or a server is spawned (they used to fail after the run, inside the
    warm-up, or with a traceback); measured rates and times must be finite and > 0."""
    from jaxinfer.bench import driver
    from jaxinfer.bench import serve as serve_bench

    def no_engine(*a, **k):
        raise AssertionError("an engine was built")

    monkeypatch.setattr(driver, "build_engine", no_engine)
    monkeypatch.setattr(serve_bench, "start_server", no_engine)
    short = ["--prompt-lens", "16", "--input-len", "16", "--output-len", "8"]
    a_file = tmp_path / "records.json"
    a_file.write_text("")
    for argv, needle in [
        (["bench", "offline", *TINY, "--input-len", "40", "--output-len", "30",
          "--max-model-len", "64"], "input-len + output-len = 70 tokens exceeds --max-model-len "
                                    "(64)"),
        (["bench", "offline", *TINY, "--out", str(a_file)], f"--out {a_file}: cannot write"),
        (["bench", "latency", *TINY, *short, "--concurrency", "8", "--max-num-seqs", "4"],
         "--concurrency 8 > --max-num-seqs 4: at most 4 streams would run at once"),
        (["bench", "latency", *TINY, *short, "--ceilings=-5,2"], "must be finite and > 0"),
        (["bench", "latency", *TINY], "the longest request needs 4097 tokens; --max-model-len "
                                      "is 64"),
        (["bench", "serve", *TINY, "--random-input-len", "60", "--random-output-len", "30",
          "--max-model-len", "64"], "--max-model-len is 64"),
        (["bench", "serve", *TINY, "--port", "1", "--num-prompts", "1"],
         "no jaxinfer server answers at 127.0.0.1:1: UNAVAILABLE"),
    ]:
        assert main(argv) == 2, argv
        assert needle in capsys.readouterr().err, argv
    for argv in (["bench", "roofline", "--copy-gbps=-5"], ["bench", "roofline", "--tpot-ms", "0"],
                 ["bench", "roofline", "--matmul-tflops", "inf"],
                 ["bench", "offline", *TINY, "--time-limit=-1"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2 and "must be a finite number >" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["offline", "serve"])
def test_more_prompts_than_host_memory_is_a_one_line_error(command, monkeypatch, capsys):
    """``--num-prompts 100000000`` used to generate prompts until the process was killed
    (exit 137); it is refused before any prompt (or server) is made, naming the sizes."""
    from jaxinfer import kv_sizing
    from jaxinfer.bench import driver

    monkeypatch.setattr(kv_sizing, "host_available_bytes", lambda: 8 * 2**30)
    monkeypatch.setattr(driver, "random_prompts", lambda *a: pytest.fail("prompts made"))
    lens = (["--input-len", "100", "--output-len", "28"] if command == "offline" else
            ["--random-input-len", "100", "--random-output-len", "28"])
    assert main(["bench", command, *TINY, *lens, "--num-prompts", "100000000"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"jaxinfer: error: --num-prompts 100000000: 100000000 requests of ~128 "
                   f"tokens need about {1e8 * 128 * 64 / 2**30:.1f} GiB of host memory for "
                   f"their token ids; 8.0 GiB is available: run fewer prompts"], err
    # Just under the limit passes the check (8 GiB / (128 * 64 B) requests).
    driver.check_host_room(8 * 2**30 // (128 * 64), 128)
    with pytest.raises(ValueError, match="--num-prompts 1048577: "):
        driver.check_host_room(8 * 2**30 // (128 * 64) + 1, 128)
