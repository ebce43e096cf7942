"""benchmarks/decode_records.py: profile_decode summaries -> benchmark records."""

import json
import subprocess
import sys
from pathlib import Path

from benchmarks.decode_records import profile_records

ROOT = Path(__file__).resolve().parents[2]


def _summary(by_position=None):
    d = {"wall_ms_per_step": 28.0, "busy_us_per_step": 26000.0, "span_us_per_step": 26100.0,
         "classes": {"attention": 17000.0, "other": 7000.0},
         "kernels": [["paged", "attention", 17000.0, 32.0]]}
    if by_position is not None:
        d["by_position"] = by_position
    return {"config": {"model": "dummy:llama-3.1-8b", "backend": "pallas:fp8:fp8",
                       "batch": 512, "ctx": 1536, "steps": 10, "synthetic": True},
            "device": "NVIDIA H100 80GB HBM3", "patches": {"m.X": "64"}, "device-only": d}


def test_profile_record_fields_and_by_position():
    pos = {"anonymous_mosaic_gpu_kernel": [800.0, 470.0, 3280.0, 1540.0]}
    (r,) = profile_records("run1", _summary(pos), {"session": 33}, "cmd")
    assert r["name"] == "profile_decode_device_busy_us_per_step"
    assert r["value"] == 26000.0 and r["unit"] == "us" and r["command"] == "cmd"
    c = r["config"]
    assert (c["run"], c["batch"], c["session"], c["patches"]) == ("run1", 512, 33, {"m.X": "64"})
    assert c["by_position_us_per_step"] == pos
    assert c["wall_ms_per_step"] == 28.0 and c["classes_us_per_step"]["attention"] == 17000.0
    (r,) = profile_records("run1", _summary(), {}, "cmd")
    assert "by_position_us_per_step" not in r["config"]


def test_cli_writes_records_and_rejects_a_summary_without_timings(tmp_path):
    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    good.write_text(json.dumps(_summary({"k": [1.0, 2.0]})))
    bad.write_text(json.dumps({"config": {}}))
    out = tmp_path / "recs.json"
    cmd = [sys.executable, str(ROOT / "benchmarks/decode_records.py"), "--out", str(out),
           "--command", "c", "--set", "session=33"]
    subprocess.run(cmd + [f"a={good}"], check=True, capture_output=True, cwd=ROOT)
    recs = json.loads(out.read_text())
    assert len(recs) == 1 and recs[0]["config"]["session"] == 33
    p = subprocess.run(cmd + [f"b={bad}"], capture_output=True, text=True, cwd=ROOT)
    assert p.returncode != 0 and "no timed backend" in p.stderr


def test_cli_names_a_missing_summary(tmp_path):
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks/decode_records.py"), "--out",
                        str(tmp_path / "o.json"), "--command", "c", f"x={tmp_path / 'nope.json'}"],
                       capture_output=True, text=True, cwd=ROOT)
    assert p.returncode != 0 and "nope.json" in p.stderr
