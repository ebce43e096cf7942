"""Checkpoint loading: one entry point for every kind of model source.

``load_model(model)`` accepts

* a named model: ``smollm2-135m`` (default) or ``gemma3-270m`` (see :mod:`.named`);
* a ``.gguf`` file (dequantized; converted once to an orbax copy in the checkpoint cache and
  read from there on later starts, see :mod:`.orbax_store`);
* an HF checkpoint directory (``config.json`` + safetensors, see :mod:`.hf_loader`);
* a directory written by :func:`convert`;
* ``dummy:<shape>``: random weights at a named shape (see :mod:`.dummy`).

and returns a :class:`LoadedModel` whose params follow jaxinfer/models/params.py.
"""

from __future__ import annotations

import warnings
from pathlib import Path

from jaxinfer.loading.base import CheckpointError, LoadedModel, cast_params, np_dtype
from jaxinfer.loading.dummy import DUMMY_CONFIGS, load_dummy
from jaxinfer.loading.hf_loader import load_hf
from jaxinfer.loading.named import DEFAULT_MODEL, NAMED_MODELS, resolve_named
from jaxinfer.loading.orbax_store import (
    cache_path_for,
    checkpoint_dir,
    find_cached,
    is_converted,
    load_converted,
    save_converted,
)

__all__ = [
    "DEFAULT_MODEL",
    "DUMMY_CONFIGS",
    "NAMED_MODELS",
    "CheckpointError",
    "LoadedModel",
    "checkpoint_dir",
    "convert",
    "load_model",
]


def _resolve(model: str) -> tuple[str, Path]:
    """(kind, path) with kind in gguf / hf / converted; raises CheckpointError."""
    if model in NAMED_MODELS:
        return "gguf", resolve_named(model)
    p = Path(model).expanduser()
    if not p.exists():
        raise CheckpointError(
            f"model {model!r}: no such file or directory, and not a named model (known: "
            f"{', '.join(NAMED_MODELS)}; or dummy:<shape> with shape in "
            f"{', '.join(DUMMY_CONFIGS)})")
    if p.is_file():
        with open(p, "rb") as f:
            magic = f.read(4)
        if magic != b"GGUF":
            raise CheckpointError(f"{p} is not a GGUF file (starts with {magic!r}, not b'GGUF')")
        return "gguf", p
    if is_converted(p):
        return "converted", p
    if (p / "config.json").is_file():
        return "hf", p
    if (p / "model_config.json").is_file():
        raise CheckpointError(f"{p} is an incomplete converted checkpoint (no manifest.json); "
                              "delete it and convert again")
    raise CheckpointError(f"{p} has no config.json (HF checkpoint) nor manifest.json (converted "
                          "checkpoint)")


def _load_gguf(path: Path, progress: bool) -> LoadedModel:
    """float32 LoadedModel from a GGUF; the ``gguf`` package is imported only here."""
    try:
        from jaxinfer.loading.gguf_loader import load_gguf
    except ImportError as e:
        raise CheckpointError(f"reading {path} needs the gguf package (pip install 'gguf>=0.17'):"
                              f" {e}") from e
    return load_gguf(path, "float32", progress)


def load_model(model: str = DEFAULT_MODEL, *, dtype: str = "float32", progress: bool = True,
               use_cache: bool = True) -> LoadedModel:
    """Load a model's config, weights and tokenizer.

    Args:
      model: named model, ``.gguf`` path, HF directory, converted directory or
        ``dummy:<shape>`` (see the module docstring).
      dtype: "float32" or "bfloat16" (ml_dtypes) for the returned params.
      progress: show tqdm progress bars.
      use_cache: for GGUF sources, read the converted copy in the checkpoint cache if present,
        else write one after loading (a failure to write only warns).

    Returns:
      LoadedModel with params exactly ``param_shapes(config)``.

    Raises:
      CheckpointError: missing/unreadable source, unsupported architecture, missing,
        unexpected or mis-shaped tensors, missing model package.
    """
    np_dtype(dtype)
    if model.startswith("dummy:"):
        return load_dummy(model.removeprefix("dummy:"), dtype)
    kind, path = _resolve(model)
    if kind == "converted":
        return load_converted(path, dtype)
    if kind == "hf":
        return load_hf(path, dtype, progress)
    if use_cache:
        cached = find_cached(path)
        if cached is not None:
            return load_converted(cached, dtype)
    loaded = _load_gguf(path, progress)
    if use_cache:
        try:
            save_converted(cache_path_for(path), loaded, source=path)
        except (OSError, CheckpointError) as e:
            warnings.warn(f"could not cache a converted copy of {path}: {e}", stacklevel=2)
    if dtype != "float32":
        loaded.params = cast_params(loaded.params, dtype)
    return loaded


def convert(model: str, output: str | None = None, progress: bool = True) -> Path:
    """Convert a GGUF file, named model or HF directory into an orbax checkpoint directory.

    ``output`` defaults to the checkpoint cache entry for a GGUF source (where ``load_model``
    looks); it is required for HF directories. Returns the directory. Raises CheckpointError if
    ``output`` exists and is not a converted checkpoint, or for any loading error.
    """
    if model.startswith("dummy:"):
        raise CheckpointError("dummy weights are generated on the fly; nothing to convert")
    kind, path = _resolve(model)
    if kind == "converted":
        raise CheckpointError(f"{path} is already a converted checkpoint")
    if output is None:
        if kind == "hf":
            raise CheckpointError(f"give an output directory to convert HF directory {path}")
        output_path = cache_path_for(path)
        if find_cached(path) is not None:
            return output_path
    else:
        output_path = Path(output).expanduser()
        if output_path.exists():
            raise CheckpointError(f"output {output_path} already exists")
    loaded = _load_gguf(path, progress) if kind == "gguf" else load_hf(path, "float32", progress)
    return save_converted(output_path, loaded, source=path if kind == "gguf" else None)
