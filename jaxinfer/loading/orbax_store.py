"""Converted checkpoints: orbax-checkpoint params + model config + tokenizer, and their cache.

A converted checkpoint is a directory::

    params/                 orbax PyTree checkpoint (OCDBT + zarr3, uncompressed) of the params,
                            nested {"embed": [V,H], "layers": {"wq": [L,H,Hq*D], ...}}, float32;
                            FP8 projections as float8_e4m3fn with float32 "<name>_scale"
    model_config.json       ModelConfig.to_json()
    tokenizer.json ...      Tokenizer.save() output (absent for models without a tokenizer)
    manifest.json           format tag, source file (resolved path, size, mtime_ns),
                            "quantization" (null, or the FP8 scheme and every scale's shape),
                            "files" (every other file's size, checked before each load: see
                            :mod:`.converted_check`), written last

It is written into a hidden temporary sibling and renamed into place, so a killed conversion
never leaves a directory that looks complete. GGUF files are converted once into
``<checkpoint dir>/converted/<stem>-<key>/``, ``key`` hashing the source's resolved path, size
and mtime, so a changed file gets a fresh copy; an FP8 copy (``jaxinfer convert
--quantization fp8``) lives at ``<stem>-fp8-<key>/`` with the scheme hashed into ``key`` too,
and :func:`find_cached` also compares the manifest's scheme, so a float copy is never taken
for an FP8 one or the reverse. A cache entry that is damaged (a listed file missing or of
another size) or stale (manifest malformed or naming another source or scheme) is re-made from
its source and swapped in (:func:`cache_state`, ``save_converted(..., replace=True)``).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from jaxinfer.cache_root import cache_root
from jaxinfer.config import ModelConfig
from jaxinfer.loading.base import CheckpointError, LoadedModel, check_finite, np_dtype
from jaxinfer.loading.converted_check import (
    FORMAT,
    MANIFEST,
    backfill_files,
    damage,
    file_sizes,
    looks_converted,
    read_manifest,
    repair_hint,
)
from jaxinfer.loading.orbax_teardown import orbax_loops
from jaxinfer.models.params import WeightError, check_params, fp8_names, param_shapes
from jaxinfer.tokenizer import Tokenizer, TokenizerError

_E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)


# Manifest key of a GGUF file's converted copy: its model_config.json holds the file's
# general.sampling.* defaults (read since session 44). The cache is keyed by the file's size
# and time, so an entry without the key, made before, is stale and re-made from the file.
GGUF_SAMPLING_READ = "gguf_sampling_defaults"


def _is_gguf(source: str | Path | None) -> bool:
    return source is not None and str(source).endswith(".gguf")


def checkpoint_dir() -> Path:
    """Where named models are assembled and converted copies live.

    ``$JAXINFER_CHECKPOINT_DIR`` if set; else ``<repo>/checkpoints`` when running from a source
    tree (a ``checkpoints/`` folder beside ``pyproject.toml``); else
    ``$XDG_CACHE_HOME/jaxinfer/checkpoints`` (``~/.cache/jaxinfer/checkpoints`` without the
    variable; :func:`jaxinfer.cache_root.cache_root`).
    """
    env = os.environ.get("JAXINFER_CHECKPOINT_DIR")
    if env:
        return Path(env).expanduser()
    repo = Path(__file__).resolve().parents[2]
    if (repo / "checkpoints").is_dir() and (repo / "pyproject.toml").is_file():
        return repo / "checkpoints"
    return cache_root() / "checkpoints"


def source_stamp(path: str | Path) -> dict[str, Any]:
    """Identity of a source file: resolved path, size in bytes, mtime in ns."""
    p = Path(path).resolve()
    st = p.stat()
    return {"path": str(p), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def cache_path_for(source: str | Path, root: Path | None = None,
                   scheme: dict[str, Any] | None = None) -> Path:
    """Directory the converted copy of ``source`` lives in (whether or not it exists yet);
    ``scheme``: the quantize-on-load scheme of an FP8 copy (``quantization.fp8_scheme()``)."""
    stamp: dict[str, Any] = source_stamp(source)
    tag = ""
    if scheme is not None:
        stamp = {**stamp, "quantization": scheme}
        tag = f"-{scheme['method']}"
    key = hashlib.sha256(json.dumps(stamp, sort_keys=True).encode()).hexdigest()[:12]
    return (root or checkpoint_dir()) / "converted" / f"{Path(source).stem}{tag}-{key}"


def is_converted(path: str | Path) -> bool:
    """Whether ``path`` holds a converted checkpoint's manifest (a JSON object with our format
    tag, written last); whether its files are intact is :func:`.converted_check.damage`."""
    return read_manifest(path) is not None


def cache_state(source: str | Path, root: Path | None = None,
                scheme: dict[str, Any] | None = None) -> tuple[Path, str, str]:
    """``(path, state, why)`` of the cache entry for ``source`` (float, or FP8 quantized with
    ``scheme``). ``state``: "ok" (usable), "absent", "stale" (manifest malformed, or naming
    another source or scheme), "damaged" (a file missing or cut short) -- both re-made by
    the loader and ``jaxinfer convert`` -- or "foreign" (something that is not a converted
    copy's layout, never touched). ``why`` says what is wrong ("" for ok / absent). A
    symbolic link at the entry (a cache moved to another disk) is read through when it
    leads to a usable copy, and is otherwise "foreign": nothing is deleted through it."""
    path = cache_path_for(source, root, scheme)
    if not path.exists() and not path.is_symlink():  # (a dangling link or loop: below)
        return path, "absent", ""
    if path.is_symlink():
        _, state, why = _dir_state(path, source, scheme)
        if state == "ok":
            return path, state, why
        return path, "foreign", f"a symbolic link to a copy that is not usable ({why})"
    return _dir_state(path, source, scheme)


def _dir_state(path: Path, source: str | Path,
               scheme: dict[str, Any] | None) -> tuple[Path, str, str]:
    """:func:`cache_state` of an existing entry, symbolic links followed."""
    if not path.is_dir() or not looks_converted(path):
        return path, "foreign", "not a converted checkpoint's layout"
    manifest = read_manifest(path)
    if manifest is None:
        return path, "stale", f"its {MANIFEST} is missing, malformed or of another format"
    q = manifest.get("quantization")
    q_scheme = q.get("scheme") if isinstance(q, dict) else None
    same = q is None if scheme is None else q_scheme == scheme
    if not same or manifest.get("source") != source_stamp(source):
        return path, "stale", f"its {MANIFEST} names another source file or quantization"
    if _is_gguf(source) and not manifest.get(GGUF_SAMPLING_READ):
        return path, "stale", ("it was made by a jaxinfer that did not read the file's "
                               "general.sampling.* default sampling params")
    why = damage(path, manifest)
    return (path, "damaged", why) if why else (path, "ok", "")


def find_cached(source: str | Path, root: Path | None = None,
                scheme: dict[str, Any] | None = None) -> Path | None:
    """The converted copy of ``source`` (float, or FP8 quantized with ``scheme``) if one
    exists, its manifest matches the file now and the scheme asked for, and its files are
    all there (:func:`cache_state` is "ok")."""
    path, state, _ = cache_state(source, root, scheme)
    return path if state == "ok" else None


def _nest(params: dict[str, np.ndarray]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for k, v in params.items():
        head, _, tail = k.partition(".")
        if tail:
            tree.setdefault(head, {})[tail] = v
        else:
            tree[head] = v
    return tree


def _flatten(tree: dict[str, Any]) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update({f"{k}.{kk}": vv for kk, vv in v.items()})
        else:
            out[k] = v
    return out


def remove_stale_temps(parent: Path, name: str | None) -> None:
    """Delete the temporaries of ``parent / name`` whose writing process is gone: exactly
    ``.<name>.tmp-<pid>`` and ``.<name>.tmp-<pid>-<hex>``, the names this package writes
    (``name`` None: of any name -- only for the checkpoint cache, a directory of ours).
    Nothing else in ``parent`` is touched: a user's ``--output`` parent may hold anything
    (every ``.*.tmp-*`` there used to be deleted)."""
    stem = r"[^/]+" if name is None else re.escape(name)
    pattern = re.compile(rf"\.{stem}\.tmp-(\d+)(-[0-9a-f]+)?")
    for p in parent.glob(".*.tmp-*" if name is None else f".{glob.escape(name)}.tmp-*"):
        m = pattern.fullmatch(p.name)
        if m is None:
            continue
        try:
            os.kill(int(m.group(1)), 0)
        except ProcessLookupError:
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
        except (ValueError, IndexError, PermissionError):
            pass


def check_can_create(out: str | Path, what: str, hint: str = "") -> None:
    """Raise CheckpointError ``"<what> <out>: cannot create it in <dir> (<reason>)<hint>"``
    unless the nearest existing folder above ``out`` takes a new directory (probed with one
    made and removed): a conversion checks this before it reads the model, as its write
    would otherwise fail at the end, on a temporary name."""
    parent = next((p for p in Path(out).absolute().parents if p.exists()), None)
    if parent is None:
        return
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".jaxinfer-probe-", dir=parent))
    except OSError as e:
        raise CheckpointError(f"{what} {out}: cannot create it in {parent} "
                              f"({e.strerror or e}){hint}") from None


def save_converted(out: str | Path, model: LoadedModel,
                   source: str | Path | None = None,
                   scheme: dict[str, Any] | None = None,
                   replace: Callable[[Path], bool] | None = None) -> Path:
    """Write ``model`` as a converted checkpoint at ``out`` atomically; returns ``out``.

    Params are stored as float32, except FP8 projections (float8_e4m3fn, as they are) and
    their float32 scales; ``scheme`` (the quantize-on-load scheme that made them, or None for
    weights that came in FP8 or are not quantized) goes into the manifest. If another process
    finished the same directory first, its copy is kept. Raises CheckpointError when ``out``
    exists and is not a converted checkpoint, or is a symbolic link.

    ``replace``: ``out`` is a damaged or stale copy to replace (the caller checked its layout,
    :func:`cache_state`): the new copy is written beside it and swapped in, the old one
    renamed to a temporary name and deleted; ``replace(out)`` is asked again just before the
    swap, so a copy another process re-made meanwhile (False) is kept.
    """
    import orbax.checkpoint as ocp

    out = Path(out).absolute()
    out.parent.mkdir(parents=True, exist_ok=True)
    ours = out.parent == (checkpoint_dir() / "converted").absolute()
    remove_stale_temps(out.parent, None if ours else out.name)
    if out.is_symlink():  # cache_state reads through a link, never writes through one
        raise CheckpointError(f"{out} is a symbolic link (to {os.readlink(out)}); no "
                              f"converted copy is written through it: repair or delete it")
    if out.exists() and replace is None:
        if is_converted(out):
            return out
        raise CheckpointError(f"{out} already exists and is not a converted checkpoint")
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    old = out.parent / f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir()
        fp8 = fp8_names(model.params)
        tree = _nest({k: np.asarray(v) if k in fp8 else np.asarray(v, dtype=np.float32)
                      for k, v in model.params.items()})
        # Uncompressed: zstd saves ~30 % of disk but doubles restore time (measured).
        handler = ocp.PyTreeCheckpointHandler(use_compression=False)
        with ocp.Checkpointer(handler) as ckptr:
            ckptr.save(tmp / "params", args=ocp.args.PyTreeSave(tree))
        (tmp / "model_config.json").write_text(model.config.to_json())
        if model.tokenizer is not None:
            model.tokenizer.save(tmp)
        quant = None if not fp8 else {
            "method": "fp8", "scheme": scheme,
            "scales": {k + "_scale": list(model.params[k + "_scale"].shape) for k in fp8}}
        manifest = {"format": FORMAT, "created_unix": time.time(), "dtype": "float32",
                    "source": source_stamp(source) if source is not None else None,
                    "from": model.source, "quantization": quant, "files": file_sizes(tmp)}
        if _is_gguf(source):
            manifest[GGUF_SAMPLING_READ] = True  # model_config.json holds its defaults
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
        if replace is not None and out.exists():
            if not replace(out):  # re-made by another process meanwhile: keep it
                return out
            try:
                os.rename(out, old)  # a temporary name: remove_stale_temps knows it
            except FileNotFoundError:
                pass
        try:
            os.rename(tmp, out)
        except OSError:
            if is_converted(out):  # a concurrent conversion won the race
                return out
            raise
    finally:
        for t in (tmp, old):
            if t.exists():
                shutil.rmtree(t, ignore_errors=True)
    return out


def load_converted(path: str | Path, dtype: str = "float32") -> LoadedModel:
    """Read a converted checkpoint; params restored as numpy arrays of ``dtype`` (FP8
    projections as stored, float8_e4m3fn, with float32 scales).

    Raises CheckpointError when the directory is incomplete or its tensors do not match its
    config.
    """
    import orbax.checkpoint as ocp

    d = Path(path).absolute()
    cfg, tokenizer = read_converted_header(d)
    dt = np_dtype(dtype)
    manifest = read_manifest(d) or {}
    hint = repair_hint(d, manifest)
    quant = manifest.get("quantization") or {}
    scales = set(quant.get("scales", {})) if isinstance(quant, dict) else set()
    fp8 = {k.removesuffix("_scale") for k in scales}

    def arg(k: str) -> Any:  # stored dtype for FP8 weights, float32 for scales
        return ocp.RestoreArgs(restore_type=np.ndarray,
                               dtype=None if k in fp8 else np.float32 if k in scales else dt)

    names = list(param_shapes(cfg)) + sorted(scales)
    args = _nest({k: arg(k) for k in names})
    try:
        with orbax_loops(), ocp.PyTreeCheckpointer() as ckptr:
            meta = ckptr.metadata(d / "params")
            if getattr(meta, "item_metadata", True) is None:
                # orbax could not read the tree's metadata: a restore would fail after
                # starting reads it cannot cancel (tracebacks from tensorstore's threads)
                raise CheckpointError(f"the converted checkpoint {d} is damaged: orbax cannot "
                                      f"read the metadata of {d}/params; {hint}")
            stored = _stored_dtypes(meta)
            tree = ckptr.restore(d / "params", args=ocp.args.PyTreeRestore(restore_args=args))
    except CheckpointError:
        raise
    except Exception as e:  # orbax/tensorstore raise many kinds
        raise CheckpointError(
            f"the converted checkpoint {d} is damaged: cannot restore its params ({hint}); "
            f"the first failed read (not necessarily the only damaged tensor): {e}") from e
    if stored is not None:  # what is on disk must be what the manifest describes
        on_disk_fp8 = {k for k, dt in stored.items() if np.dtype(dt) == _E4M3}
        if set(stored) != set(names) or on_disk_fp8 != fp8:
            raise CheckpointError(
                f"{d}: stored tensors do not match {MANIFEST} (FP8 on disk: "
                f"{sorted(on_disk_fp8)}, in the manifest: {sorted(fp8)}; other differences: "
                f"{sorted(set(stored) ^ set(names))[:5]})")
    params = {k: v for k, v in _flatten(tree).items() if k in names}
    for k, v in params.items():  # a flipped byte restores without complaint
        check_finite(v, k, str(d))
    try:
        check_params(cfg, params, str(d))
    except WeightError as e:
        raise CheckpointError(str(e)) from e
    if set(fp8_names(params)) != fp8:
        raise CheckpointError(f"{d}: FP8 tensors {sorted(fp8_names(params))} do not match the "
                              f"manifest's {sorted(fp8)}")
    if "files" not in manifest:  # a copy from before the file list: list it now (good)
        remove_stale_temps(d, MANIFEST)  # a backfill whose process died
        backfill_files(d, manifest)
    return LoadedModel(config=cfg, params=params, tokenizer=tokenizer, source=str(d))


def _stored_dtypes(meta: Any) -> dict[str, Any] | None:
    """{name: dtype} of an orbax PyTree checkpoint's metadata (StepMetadata / TreeMetadata /
    a plain tree across orbax versions); None when the layout is not one of these."""
    tree = getattr(getattr(meta, "item_metadata", meta), "tree", meta)
    if not isinstance(tree, dict):
        return None
    flat = _flatten(tree)
    if not all(hasattr(v, "dtype") for v in flat.values()):
        return None
    return {k: v.dtype for k, v in flat.items()}


def read_converted_header(d: Path) -> tuple[ModelConfig, Tokenizer | None]:
    """(config, tokenizer or None) of a converted checkpoint, without reading its params.

    Raises CheckpointError when the directory is incomplete or its files cannot be read."""
    manifest = read_manifest(d)
    if manifest is None:
        raise CheckpointError(f"{d} is not a complete converted checkpoint (no {MANIFEST} "
                              f"with format {FORMAT!r})")
    why = damage(d, manifest)
    if why:
        raise CheckpointError(f"the converted checkpoint {d} is damaged: {why}; "
                              f"{repair_hint(d, manifest)}")
    try:
        cfg = ModelConfig.from_json((d / "model_config.json").read_text())
    except (OSError, ValueError, TypeError) as e:
        raise CheckpointError(f"{d}/model_config.json: {e}") from e
    tokenizer = None
    if (d / "tokenizer.json").is_file():
        try:
            tokenizer = Tokenizer.from_pretrained(d)
        except TokenizerError as e:
            raise CheckpointError(str(e)) from e
    return cfg, tokenizer
