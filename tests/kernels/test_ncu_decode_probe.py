"""benchmarks/kernels/ncu_decode_probe.py on the CPU: case parsing, the summary of an ncu
CSV (the layout of ``ncu --csv --page details``), and the checked launches in interpret mode."""

from __future__ import annotations

import json

import pytest

from benchmarks.kernels import ncu_decode_probe as probe

HEAD = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream",'
        '"Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit",'
        '"Metric Value"\n')


def row(i: int, kernel: str, section: str, name: str, unit: str, value: str) -> str:
    return (f'"{i}","1","python3","h","{kernel}","1","7","(64, 1, 1)","(8, 64, 4)","0","9.0",'
            f'"{section}","{name}","{unit}","{value}"\n')


def test_summarize_reads_metrics_units_and_stalls() -> None:
    text = ("==PROF== Connected to process 1\n" + HEAD
            + row(0, "paged_decode_bt64_s2", "GPU Speed Of Light Throughput", "Duration",
                  "usecond", "81.50")
            + row(0, "paged_decode_bt64_s2", "GPU Speed Of Light Throughput",
                  "DRAM Throughput", "%", "74.1")
            + row(0, "paged_decode_bt64_s2", "Command line profiler metrics",
                  probe.STALL_PREFIX + "long_scoreboard" + probe.STALL_SUFFIX, "", "3.5")
            + row(0, "paged_decode_bt64_s2", "Command line profiler metrics",
                  probe.STALL_PREFIX + "wait" + probe.STALL_SUFFIX, "", "0.5")
            + row(0, "paged_decode_bt64_s2", "Command line profiler metrics",
                  probe.STALL_PREFIX + "barrier" + probe.STALL_SUFFIX, "", "1,200.25")
            + row(0, "paged_decode_bt64_s2", "Command line profiler metrics",
                  probe.STALL_PREFIX + "math" + probe.STALL_SUFFIX, "", "0.1")
            + row(1, "paged_decode_kq", "GPU Speed Of Light Throughput", "Duration",
                  "nsecond", "12,500"))
    rows = probe.summarize(text)
    assert [r["id"] for r in rows] == [0, 1]
    assert rows[0]["us"] == pytest.approx(81.5) and rows[0]["dram%"] == pytest.approx(74.1)
    assert rows[1]["us"] == pytest.approx(12.5)
    assert [n for n, _ in rows[0]["top_stalls"]] == ["barrier", "long_scoreboard", "wait"]
    assert rows[0]["top_stalls"][0][1] == pytest.approx(1200.25)
    assert rows[1]["top_stalls"] == []


def test_summarize_without_a_table_says_so() -> None:
    with pytest.raises(ValueError, match="no ncu CSV table"):
        probe.summarize("==ERROR== LibraryNotLoaded\n")


def test_parse_cases() -> None:
    assert probe.parse_cases("bf16:64x2048,fp8:8x4096@kq8_bt64_w2") == [
        ("bf16", 64, 2048, {}), ("fp8", 8, 4096, {"fp8_variant": "kq8_bt64_w2"})]
    for bad in ("int8:1x2", "fp8:64", "bf16:axb"):
        with pytest.raises(ValueError, match="--cases"):
            probe.parse_cases(bad)


def test_cpu_smoke_checks_every_case(tmp_path, capsys) -> None:
    out = tmp_path / "checks.json"
    probe.main(["--cpu-smoke", "--launches", "1", "--cases",
                "bf16:64x2048,fp8:8x4096@kq8_bt64_w2", "--out", str(out)])
    res = json.loads(out.read_text())
    assert [r["case"] for r in res] == ["bf16:2x256", "fp8:2x256"]
    assert all(r["ok"] and r["rel_err"] < probe.CHECK_LIMIT for r in res)
    assert res[1]["fp8_variant"] == "kq8_bt64_w2"


def test_profiler_range_wraps_only_the_final_launches(monkeypatch, tmp_path) -> None:
    """--profiler-range: cuProfilerStart / Stop (the CUDA driver through ctypes, faked here)
    bracket each case's final launches -- one start and one stop a case, the checked warm-up
    outside; disabled, the driver is never loaded."""
    import ctypes

    calls = []

    class FakeDriver:
        def cuProfilerStart(self):
            calls.append("start")

        def cuProfilerStop(self):
            calls.append("stop")

    loaded = []
    monkeypatch.setattr(ctypes, "CDLL", lambda name: loaded.append(name) or FakeDriver())
    assert probe.ProfilerRange(False).lib is None and loaded == []
    probe.main(["--cpu-smoke", "--launches", "1", "--profiler-range", "--cases",
                "bf16:1x16,fp8:1x16", "--out", str(tmp_path / "c.json")])
    assert loaded == ["libcuda.so.1"]
    assert calls == ["start", "stop", "start", "stop"]
