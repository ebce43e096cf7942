"""Cheap checks of a converted checkpoint directory (see :mod:`.orbax_store`): its manifest,
the files it lists with their sizes, and whether a directory is recognisably one of ours.

A cache must notice a damaged or stale copy before orbax reads it: a missing or truncated
file under ``params/`` otherwise fails deep inside tensorstore (with a message naming
whatever tensor was read first), and a copy missing ``tokenizer.json`` would load as a model
without a tokenizer. The manifest written since this module records every file's size
(``"files"``), as HF's and vLLM's caches verify a download by size; copies written before
are checked for the files every copy has.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

FORMAT = "jaxinfer-orbax-v1"
MANIFEST = "manifest.json"
# Files every converted copy has (older manifests do not list their files).
_ALWAYS = ("model_config.json", "params/_METADATA", "params/manifest.ocdbt")
# Top-level files a converted copy may hold besides params/: ours and what a tokenizer's
# save_pretrained writes.
_FILE_SUFFIXES = (".json", ".jinja", ".txt", ".model")
# The manifest being rewritten by backfill_files (orbax_store.remove_stale_temps's pattern).
_MANIFEST_TEMP = re.compile(rf"\.{re.escape(MANIFEST)}\.tmp-\d+")


def read_manifest(d: str | Path) -> dict[str, Any] | None:
    """The manifest of ``d`` when it is a JSON object with our format tag; None when it is
    missing, unreadable, malformed (not JSON, not an object: ``[1]``) or of another format."""
    try:
        m = json.loads((Path(d) / MANIFEST).read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return m if isinstance(m, dict) and m.get("format") == FORMAT else None


def file_sizes(d: Path) -> dict[str, int]:
    """``{path relative to d (posix): size in bytes}`` of every file under ``d`` except the
    manifest (and a manifest being rewritten by :func:`backfill_files`)."""
    return {p.relative_to(d).as_posix(): p.stat().st_size for p in sorted(d.rglob("*"))
            if p.is_file() and p.relative_to(d).as_posix() != MANIFEST
            and not (p.parent == d and _MANIFEST_TEMP.fullmatch(p.name))}


def damage(d: Path, manifest: dict[str, Any]) -> str | None:
    """What is missing or cut short in converted checkpoint ``d`` (one phrase), or None.

    Checks the files the manifest lists (exist, recorded size), or for manifests without a
    list the files every copy has; and that a copy with tokenizer metadata has its
    ``tokenizer.json``. Reads no tensor data."""
    files = manifest.get("files")
    if files is not None:
        if not isinstance(files, dict):
            return f"its {MANIFEST} has a malformed 'files' entry"
        for rel, size in files.items():
            p = d / rel
            if not p.is_file():
                return f"{rel} is missing"
            actual = p.stat().st_size
            if actual != size:
                return f"{rel} has {actual} bytes, {size} when written"
    else:
        for rel in _ALWAYS:
            if not (d / rel).is_file():
                return f"{rel} is missing"
    if not (d / "tokenizer.json").is_file():
        for other in ("jaxinfer_tokenizer.json", "tokenizer_config.json"):
            if (d / other).is_file():
                return f"tokenizer.json is missing ({other} is there)"
    return None


def backfill_files(d: Path, manifest: dict[str, Any]) -> bool:
    """Record the sizes of the files the restore reads (``params/``, ``model_config.json``)
    in the manifest of ``d`` when it has no list (a copy written before the list existed),
    so the next start's cheap check sees a file cut short or lost later instead of orbax
    failing mid-restore. Other top-level files are not listed (a user's note there must not
    make the copy "damaged"). Call only after a load of ``d`` succeeded (the sizes on disk
    are then the good ones). Written beside (``.manifest.json.tmp-<pid>``) and renamed over
    (atomic); a read-only cache is left as it is. Returns whether it wrote."""
    if not manifest or "files" in manifest:
        return False
    files = {k: v for k, v in file_sizes(d).items()
             if k.startswith("params/") or k == "model_config.json"}
    tmp = d / f".{MANIFEST}.tmp-{os.getpid()}"
    try:
        tmp.write_text(json.dumps({**manifest, "files": files}, indent=1))
        os.replace(tmp, d / MANIFEST)
    except OSError:
        tmp.unlink(missing_ok=True)
        return False
    return True


def looks_converted(d: Path) -> bool:
    """Whether directory ``d`` has a converted copy's layout: a ``params/`` directory or a
    ``model_config.json``, and nothing else but top-level .json/.jinja/.txt/.model files.
    Only such a directory in the cache is ever replaced; anything else there is left
    alone (a user's files are never deleted)."""
    try:
        entries = list(d.iterdir())
    except OSError:
        return False
    names = {e.name for e in entries}
    if "params" not in names and "model_config.json" not in names:
        return False
    for e in entries:
        if _MANIFEST_TEMP.fullmatch(e.name):  # a backfill in progress (or cut short)
            continue
        if e.name == "params":
            if not e.is_dir() or e.is_symlink():
                return False
        elif e.is_symlink() or not e.is_file() or not e.name.endswith(_FILE_SUFFIXES):
            return False
    return True


def _in_cache(d: Path) -> bool:
    """Whether ``d`` lies in the converted-checkpoint cache (which loads re-make), not at an
    ``--output`` path of the user's."""
    from jaxinfer.loading.orbax_store import checkpoint_dir  # (that module imports this one)

    try:
        return Path(d).resolve().is_relative_to(checkpoint_dir().resolve())
    except OSError:
        return False


def repair_hint(d: Path, manifest: dict[str, Any] | None) -> str:
    """How to repair damaged converted checkpoint ``d`` (one phrase)."""
    m = manifest if isinstance(manifest, dict) else {}
    src = m.get("from")
    if not isinstance(src, str) or not src:
        return f"delete {d} and convert its source again (`jaxinfer convert`)"
    if isinstance(m.get("source"), dict) and _in_cache(d):  # the cache's own copy of a GGUF
        return (f"delete {d} (the next load re-makes it from {src}) or run "
                f"`jaxinfer convert --model {src}`, which re-converts it")
    return f"delete {d} and run `jaxinfer convert --model {src} --output {d}`"
