"""Benchmark result records: ``{"name", "value", "unit", "config", "device", "jax", "date",
"command"}``, one JSON file per value (:func:`record`) or one file per run holding a list
(:func:`write_run`). ``benchmarks/common.py`` re-exports these for the scripts under
``benchmarks/``.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import re
import shlex
import sys
from pathlib import Path
from typing import Any

# Default output folder: the repository's benchmarks/results/ (an installed package without
# the repository writes to ./benchmarks/results/ under the working directory).
_REPO_RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
RESULTS = _REPO_RESULTS if _REPO_RESULTS.parent.is_dir() else Path("benchmarks") / "results"


def device_name() -> str:
    """``"cpu: <model name> x<cores>"`` or ``"<platform>: <device kind>"`` of JAX's first
    device (the machine's architecture if JAX is absent, e.g. in a peer's venv)."""
    try:
        import jax

        d = jax.devices()[0]
        if d.platform == "cpu":
            cpu = platform.processor() or platform.machine()
            try:
                for line in Path("/proc/cpuinfo").read_text().splitlines():
                    if line.startswith("model name"):
                        cpu = line.split(":", 1)[1].strip()
                        break
            except OSError:
                pass
            return f"cpu: {cpu} x{os.cpu_count()}"
        return f"{d.platform}: {d.device_kind}"
    except Exception:  # noqa: BLE001 - jax absent in a peer venv
        return platform.machine()


def _jax_version() -> str | None:
    try:
        import jax

        return jax.__version__
    except ImportError:
        return None


def _now() -> _dt.datetime:
    return _dt.datetime.now(_dt.UTC)


def make_record(name: str, value: Any, unit: str, config: dict[str, Any],
                command: str | None = None) -> dict[str, Any]:
    """One record (not written). ``command`` defaults to this process's command line."""
    return {"name": name, "value": value, "unit": unit, "config": config,
            "device": device_name(), "jax": _jax_version(),
            "date": _now().isoformat(timespec="seconds"),
            "command": command or " ".join(shlex.quote(a) for a in
                                           [sys.executable.split("/")[-1]] + sys.argv)}


def check_out_dir(out_dir: str | Path | None) -> None:
    """Create ``--out`` (default: benchmarks/results) now and check that a record can be
    written there; raises ValueError otherwise -- before a run, whose results would
    otherwise be lost at its end (a file given as --out was refused only then)."""
    out = Path(out_dir) if out_dir is not None else RESULTS
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write-probe-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise ValueError(f"--out {out}: cannot write records there ({e.strerror or e})") from None


def _path(out_dir: Path | None, name: str) -> Path:
    out = Path(out_dir) if out_dir is not None else RESULTS
    out.mkdir(parents=True, exist_ok=True)
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", name)
    return out / f"{slug}-{_now().strftime('%Y%m%dT%H%M%S%f')}.json"


def record(name: str, value: Any, unit: str, config: dict[str, Any],
           out_dir: Path | None = None, command: str | None = None) -> dict[str, Any]:
    """Write one result record to ``<out_dir>/<name>-<utc timestamp>.json``; return it."""
    rec = make_record(name, value, unit, config, command)
    _path(out_dir, name).write_text(json.dumps(rec, indent=1) + "\n")
    return rec


def write_run(run_name: str, records: list[dict[str, Any]], out_dir: Path | None = None
              ) -> Path:
    """Write the records of one run as a JSON list to ``<out_dir>/<run_name>-<utc
    timestamp>.json``; returns the path. NaN and inf are written as null."""
    path = _path(out_dir, run_name)
    path.write_text(json.dumps(_finite(records), indent=1, allow_nan=False) + "\n")
    return path


def _finite(x: Any) -> Any:
    """NaN / inf floats -> None (strict JSON), through dicts and lists."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x
