"""Result records shared by all benchmarks: one JSON file per measured value.

Record: ``{"name", "value", "unit", "config": {...}, "device", "jax", "date", "command"}``
written to ``benchmarks/results/<name>-<utc timestamp>.json``.
"""

from __future__ import annotations

import datetime as _dt
import json
import platform
import re
import shlex
import sys
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def device_name() -> str:
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
            import os

            return f"cpu: {cpu} x{os.cpu_count()}"
        return f"{d.platform}: {d.device_kind}"
    except Exception:  # noqa: BLE001 - jax absent in a peer venv
        return platform.machine()


def record(name: str, value: float, unit: str, config: dict[str, Any],
           out_dir: Path | None = None, command: str | None = None) -> dict[str, Any]:
    """Write one result record and return it."""
    try:
        import jax

        jax_version = jax.__version__
    except ImportError:
        jax_version = None
    now = _dt.datetime.now(_dt.timezone.utc)
    rec = {"name": name, "value": value, "unit": unit, "config": config,
           "device": device_name(), "jax": jax_version, "date": now.isoformat(timespec="seconds"),
           "command": command or " ".join(shlex.quote(a) for a in [sys.executable.split("/")[-1]]
                                          + sys.argv)}
    out = out_dir or RESULTS
    out.mkdir(parents=True, exist_ok=True)
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", name)
    (out / f"{slug}-{now.strftime('%Y%m%dT%H%M%S%f')}.json").write_text(
        json.dumps(rec, indent=1) + "\n")
    return rec
