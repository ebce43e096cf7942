"""Result records shared by all benchmarks (one JSON file per measured value), and the
``--patch MODULE.NAME=VALUE`` option of the A/B benchmarks.

Record: ``{"name", "value", "unit", "config": {...}, "device", "jax", "date", "command"}``
written to ``benchmarks/results/<name>-<utc timestamp>.json``. The implementation lives in
``jaxinfer/bench/records.py`` (the ``jaxinfer bench`` commands write the same records).
"""

from __future__ import annotations

import ast
import importlib

from jaxinfer.bench.records import RESULTS, device_name, record, write_run

__all__ = ["RESULTS", "apply_patches", "device_name", "record", "write_run"]


def apply_patches(specs: list[str], prog: str = "benchmark") -> dict[str, object]:
    """Set ``module.NAME = literal`` for each "module.NAME=VALUE" spec (an A/B of a plan
    constant with no environment switch, e.g.
    ``pallas_kernels.paged_attention.decode_merge.MERGE_PRELOAD_CHUNKS=0``); returns {target:
    value}. Raises SystemExit naming ``prog`` and the spec for a missing module or constant
    or a VALUE that is not a Python literal."""
    done = {}
    for spec in specs:
        target, sep, value = spec.partition("=")
        mod_name, _, const = target.rpartition(".")
        try:
            if not (sep and mod_name):
                raise ValueError("expected MODULE.NAME=VALUE")
            mod = importlib.import_module(mod_name)
            if not hasattr(mod, const):
                raise AttributeError(f"{mod_name} has no {const}")
            setattr(mod, const, ast.literal_eval(value))
        except (ValueError, SyntaxError, ImportError, AttributeError) as e:
            raise SystemExit(f"{prog}: --patch {spec!r}: {e}") from None
        done[target] = getattr(mod, const)
    return done
