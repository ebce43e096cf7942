"""The same KV pool on every start, so that JAX's persistent compilation cache serves them.

The pool's shape ``[L, Hkv, pages, page_size, D]`` is in every program, and on a GPU its page
count comes from free memory (``kv_sizing``), which moves a little between starts of the same
command: Llama-3.1-8B FP8 on an H100 found 8.79 GiB in use on its first start and 8.72 GiB on
its second, so 45,529 then 45,601 pages of 1 MiB, and the second start compiled its prefill and
decode programs again instead of loading them (session 46, scripts/gpu_call_s46_a.sh).

So where the XLA cache is on (``jax_compilation_cache_dir``) and the pool is sized from device
memory, the first start takes ``SLACK`` fewer pages than fit and records the count in
``<cache dir>/jaxinfer-kv-pages.json`` under a key of everything else that shapes the pool (model
and engine configuration, KV dtype, device kind, XLA's memory limit, jax version); a later start
adopts the recorded count where it still fits and is at most ``ADOPT_WITHIN`` below what fits
now (a start with much more room sizes afresh). An explicit ``num_kv_pages``, a compile cache
(which fixes the count itself) and the CPU (sized from ``max_num_seqs``) are left as they are.
vLLM needs none of this: its compiled graphs do not hold the block count.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

from jaxinfer import kv_sizing
from jaxinfer.kv_sizing import KVSizing

log = logging.getLogger(__name__)

MEMO_FILE = "jaxinfer-kv-pages.json"
SLACK = 0.005  # the first start leaves this fraction of the pages that fit (0.2 GiB of 45 GiB)
ADOPT_WITHIN = 0.02  # a recorded count this fraction or less below what fits now is adopted


def memo_key(model_config: Any, engine_config: Any, sizing: KVSizing, device_kind: str,
             bytes_limit: int, jax_version: str) -> str:
    """A hex digest of what fixes the pool's size apart from free memory (dataclass configs
    as their fields; ``num_kv_pages`` is None here: the memo serves memory-sized pools)."""
    fields = {"model": dataclasses.asdict(model_config),
              "engine": dataclasses.asdict(engine_config),
              "kv": [sizing.kv_dtype, sizing.page_size, sizing.page_bytes, sizing.scale_bytes],
              "device": [device_kind, int(bytes_limit)], "jax": jax_version}
    text = json.dumps(fields, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def choose_pages(records: dict[str, Any], key: str, fit: int, need: int) -> tuple[int, bool]:
    """``(pages, adopted)``: the recorded count under ``key`` where ``need <= it <= fit`` and
    ``it >= fit * (1 - ADOPT_WITHIN)``; else ``fit`` less ``SLACK`` (at least ``need``, the
    pages one ``max_model_len`` sequence needs, and at most ``fit``), which the caller records."""
    rec = records.get(key)
    if (isinstance(rec, int) and not isinstance(rec, bool) and need <= rec <= fit
            and rec >= fit * (1 - ADOPT_WITHIN)):
        return rec, True
    return min(fit, max(need, fit - int(fit * SLACK))), False


def read_records(path: Path) -> dict[str, Any]:
    """The memo at ``path`` as a dict; {} where it is missing or unreadable (a damaged memo
    costs a start its programs, nothing else)."""
    try:
        records = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return records if isinstance(records, dict) else {}


def write_records(path: Path, records: dict[str, Any]) -> None:
    """Replace the memo atomically (a temporary file renamed over it: two starts writing at
    once leave one of their versions, never a torn file); an OSError is logged, not raised."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".kv-pages-", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump(records, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError as e:
        log.info("KV page memo %s not written: %s", path, e)


def cache_directory() -> str | None:
    """JAX's persistent compilation cache directory in this process (None: the cache is off)."""
    import jax

    return jax.config.jax_compilation_cache_dir or None


def stabilize(sizing: KVSizing, model_config: Any, engine_config: Any) -> KVSizing:
    """``sizing`` with the page count of an earlier start (module docstring), or with
    ``SLACK`` fewer pages recorded for the next one; unchanged unless it was sized from device
    memory with JAX's persistent compilation cache on."""
    import jax

    directory = cache_directory()
    if sizing.source != "device memory" or not directory:
        return sizing
    stats = kv_sizing.device_memory_stats() or {}  # the sizing's source (tests fake it)
    key = memo_key(model_config, engine_config, sizing, jax.devices()[0].device_kind,
                   stats.get("bytes_limit", 0), jax.__version__)
    path = Path(directory) / MEMO_FILE
    records = read_records(path)
    need = engine_config.max_pages_per_seq + 1
    pages, adopted = choose_pages(records, key, sizing.num_pages, need)
    if not adopted:
        records[key] = pages
        write_records(path, records)
    note = (f"{pages - 1} as an earlier start, for its cached programs; {sizing.num_pages - 1} "
            f"fit" if adopted else f"{sizing.num_pages - 1} fit, {SLACK:.1%} left so that later "
            f"starts keep the count and their cached programs")
    note = f"{sizing.note}; {note}" if sizing.note else note
    return dataclasses.replace(sizing, num_pages=pages, note=note)
