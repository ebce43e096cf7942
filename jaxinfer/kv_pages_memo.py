"""The same KV pool on every start, so that JAX's persistent compilation cache serves them.

The pool's shape ``[L, Hkv, pages, page_size, D]`` is in every program, and on a GPU its page
count comes from free memory (``kv_sizing``), which moves a little between starts of the same
command: Llama-3.1-8B FP8 on an H100 found 8.79 GiB in use on its first start and 8.72 GiB on
its second, so 45,529 then 45,601 pages of 1 MiB, and the second start compiled its prefill and
decode programs again instead of loading them (session 46, scripts/gpu_call_s46_a.sh).

So where the XLA cache is on (``jax_compilation_cache_dir`` on a local disk, and
``jax_enable_compilation_cache``) and the pool is sized from device memory, the first start
takes ``SLACK`` fewer pages than fit and records the count in
``<cache dir>/jaxinfer-kv-pages.json`` under a key of what shapes a page and the memory (model
configuration, KV dtype and page, device kind, XLA's memory limit, jax version); a later start
adopts a recorded count where it still fits and is at most ``ADOPT_WITHIN`` below what fits now
(a start with much more room sizes afresh). Any such count is a valid pool for any engine
configuration, so the key leaves the engine's out, and up to ``KEEP`` counts are kept a key:
two engines in one process (the second sees the first's pool in use) or two bucket sets with
different activations each find theirs. An explicit ``num_kv_pages``, a compile cache (which
fixes the count itself) and the CPU (sized from ``max_num_seqs``) are left as they are.
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
KEEP = 8  # counts kept a key, the latest last


def memo_key(model_config: Any, sizing: KVSizing, device_kind: str, bytes_limit: int,
             jax_version: str) -> str:
    """A hex digest of what fixes a page's bytes and the memory the pool comes from (the
    model configuration as its dataclass fields; not the engine's: module docstring)."""
    fields = {"model": dataclasses.asdict(model_config),
              "kv": [sizing.kv_dtype, sizing.page_size, sizing.page_bytes, sizing.scale_bytes],
              "device": [device_kind, int(bytes_limit)], "jax": jax_version}
    text = json.dumps(fields, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _counts(record: Any) -> list[int]:
    """The page counts of one record: a list of ints (an int alone also read); others
    ignored (bools, floats, strings: a memo edited by hand)."""
    items = record if isinstance(record, list) else [record]
    return [r for r in items if isinstance(r, int) and not isinstance(r, bool)]


def choose_pages(records: dict[str, Any], key: str, fit: int, need: int) -> tuple[int, bool]:
    """``(pages, adopted)``: the largest count recorded under ``key`` with ``need <= it <=
    fit`` and ``it >= fit * (1 - ADOPT_WITHIN)``; else ``fit`` less ``SLACK`` (at least
    ``need``, the pages one ``max_model_len`` sequence needs, at most ``fit``), which the
    caller records (:func:`remember`)."""
    ok = [r for r in _counts(records.get(key)) if need <= r <= fit
          and r >= fit * (1 - ADOPT_WITHIN)]
    if ok:
        return max(ok), True
    return min(fit, max(need, fit - int(fit * SLACK))), False


def remember(records: dict[str, Any], key: str, pages: int) -> None:
    """Add ``pages`` to ``key``'s counts (the latest last; the oldest beyond ``KEEP`` go)."""
    counts = [r for r in _counts(records.get(key)) if r != pages] + [pages]
    records[key] = counts[-KEEP:]


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
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".kv-pages-", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump(records, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError as e:
        log.info("KV page memo %s not written: %s", path, e)
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


def cache_directory() -> str | None:
    """JAX's persistent compilation cache directory in this process, where it is on
    (``xla_cache.active_dir``) and on a local disk (None otherwise: off, or a ``gs://`` URL,
    where the memo is not kept)."""
    from jaxinfer.xla_cache import active_dir

    return local_directory(active_dir())


def local_directory(directory: str | None) -> str | None:
    """``directory`` where it is a local path, else None (none, empty, or a URL)."""
    return directory if directory and "://" not in directory else None


def stabilize(sizing: KVSizing, model_config: Any, engine_config: Any) -> KVSizing:
    """``sizing`` with the page count of an earlier start (module docstring), or with
    ``SLACK`` fewer pages recorded for the next one; unchanged unless it was sized from device
    memory with JAX's persistent compilation cache on."""
    import jax

    directory = cache_directory()
    if sizing.source != "device memory" or not directory:
        return sizing
    stats = kv_sizing.device_memory_stats() or {}  # the sizing's source (tests fake it)
    key = memo_key(model_config, sizing, jax.devices()[0].device_kind,
                   stats.get("bytes_limit", 0), jax.__version__)
    path = Path(directory) / MEMO_FILE
    records = read_records(path)
    need = engine_config.max_pages_per_seq + 1
    pages, adopted = choose_pages(records, key, sizing.num_pages, need)
    if not adopted:
        remember(records, key, pages)
        write_records(path, records)
    note = (f"{pages - 1} as an earlier start, for its cached programs; {sizing.num_pages - 1} "
            f"fit" if adopted else f"{sizing.num_pages - 1} fit, {SLACK:.1%} left so that later "
            f"starts keep the count and their cached programs")
    note = f"{sizing.note}; {note}" if sizing.note else note
    return dataclasses.replace(sizing, num_pages=pages, note=note)
