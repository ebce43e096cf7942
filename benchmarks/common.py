"""Result records shared by all benchmarks: one JSON file per measured value.

Record: ``{"name", "value", "unit", "config": {...}, "device", "jax", "date", "command"}``
written to ``benchmarks/results/<name>-<utc timestamp>.json``. The implementation lives in
``jaxinfer/bench/records.py`` (the ``jaxinfer bench`` commands write the same records).
"""

from __future__ import annotations

from jaxinfer.bench.records import RESULTS, device_name, record, write_run

__all__ = ["RESULTS", "device_name", "record", "write_run"]
