"""Checkpoint loading: one entry point for every kind of model source.

``load_model(model)`` accepts

* a named model: ``smollm2-135m`` (default) or ``gemma3-270m`` (see :mod:`.named`);
* a ``.gguf`` file (dequantized; converted once to an orbax copy in the checkpoint cache and
  read from there on later starts, see :mod:`.orbax_store`);
* an HF checkpoint directory (``config.json`` + safetensors, see :mod:`.hf_loader`);
* a directory written by :func:`convert`;
* ``dummy:<shape>``: random weights at a named shape (see :mod:`.dummy`);
* ``dummy:<any of the above>``: random weights at that model's shape, with its tokenizer
  (vLLM's ``--load-format dummy``; the CLI's ``--load-format dummy`` adds the prefix). Only
  the source's config and tokenizer are read, never its weights.

and returns a :class:`LoadedModel` whose params follow jaxinfer/models/params.py.
"""

from __future__ import annotations

import codecs
import hashlib
import sys
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path

from jaxinfer.config import ModelConfig
from jaxinfer.loading.base import CheckpointError, LoadedModel, cast_params, np_dtype
from jaxinfer.loading.converted_check import read_manifest
from jaxinfer.loading.dummy import DUMMY_CONFIGS, dummy_params, load_dummy
from jaxinfer.loading.hf_loader import load_hf, read_hf_header
from jaxinfer.loading.named import DEFAULT_MODEL, NAMED_MODELS, resolve_named
from jaxinfer.loading.orbax_store import (
    cache_path_for,
    cache_state,
    check_can_create,
    checkpoint_dir,
    is_converted,
    load_converted,
    read_converted_header,
    save_converted,
)
from jaxinfer.tokenizer import Tokenizer

__all__ = [
    "DEFAULT_MODEL",
    "DUMMY_CONFIGS",
    "NAMED_MODELS",
    "CheckpointError",
    "LoadedModel",
    "checkpoint_dir",
    "convert",
    "dummy_header",
    "load_model",
    "read_header",
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
               use_cache: bool = True, quantization: str | None = None) -> LoadedModel:
    """Load a model's config, weights and tokenizer.

    Args:
      model: named model, ``.gguf`` path, HF directory, converted directory or
        ``dummy:<shape>`` (see the module docstring).
      dtype: "float32" or "bfloat16" (ml_dtypes) for the returned params.
      progress: show tqdm progress bars.
      use_cache: for GGUF sources, read the converted copy in the checkpoint cache if present,
        else write one after loading (a failure to write only warns).
      quantization: "fp8": the projections come back as float8_e4m3fn with float32
        ``*_scale`` (jaxinfer/models/params.py): read from an FP8 converted copy in the cache
        (``jaxinfer convert --quantization fp8``) when one matches, else quantized from the
        float32 weights now (``quantization.quantize_params_fp8``; dummy weights are made
        as FP8 directly, per output channel). Checkpoints that carry FP8 weights come back
        as they are either way (projections they keep in float stay float).

    Returns:
      LoadedModel with params ``param_shapes(config)`` (plus the FP8 scales).

    Raises:
      CheckpointError: missing/unreadable source, unsupported architecture, missing,
        unexpected or mis-shaped tensors, missing model package, unknown quantization.
    """
    np_dtype(dtype)
    if quantization is not None:
        return _load_fp8(model, dtype, progress, use_cache, quantization)
    if model.startswith("dummy:"):
        return _load_dummy_like(model.removeprefix("dummy:"), dtype)
    kind, path = _resolve(model)
    if kind == "converted":
        return load_converted(path, dtype)
    if kind == "hf":
        return load_hf(path, dtype, progress)
    replace, write_cache = None, use_cache
    if use_cache:
        cached, state, why = cache_state(path)
        linked = cached.is_symlink()
        if state == "ok":
            try:
                loaded = load_converted(cached, dtype)
                if loaded.tokenizer is not None:  # messages name what the user gave, not
                    loaded.tokenizer.source = model  # the cache's directory
                return loaded
            except CheckpointError as e:  # damage the cheap checks do not see
                state, why = "damaged", str(e)
                if linked:
                    why = f"a symbolic link to a copy that fails to load: {e}"
        if linked:  # read through a link, never re-made through one
            warnings.warn(f"not using the cache entry {cached}: {why}; reading {path} "
                          f"instead (repair or delete the link)", stacklevel=2)
            write_cache = False
        else:
            replace = _remake(cached, state, why, path)
    loaded = _load_gguf(path, progress)
    if write_cache:
        try:
            save_converted(cache_path_for(path), loaded, source=path, replace=replace)
        except (OSError, CheckpointError) as e:
            warnings.warn(f"could not cache a converted copy of {path}: {e}", stacklevel=2)
    if dtype != "float32":
        loaded.params = cast_params(loaded.params, dtype)
    return loaded


def _remake(cached: Path, state: str, why: str, source: Path,
            scheme: dict | None = None) -> Callable[[Path], bool] | None:
    """For a damaged or stale cache entry: say on stderr that it is re-made from ``source``,
    and return save_converted's ``replace`` check: replace it unless another process has
    re-made it meanwhile (its manifest changed and it checks out). None for an absent,
    foreign or usable entry."""
    if state not in ("damaged", "stale"):
        return None
    print(f"jaxinfer: the converted copy {cached} is {state} ({why}); re-converting it from "
          f"{source}", file=sys.stderr, flush=True)
    seen = read_manifest(cached)
    return lambda out: (read_manifest(out) == seen
                        or cache_state(source, scheme=scheme)[1] in ("damaged", "stale"))


def _load_fp8(model: str, dtype: str, progress: bool, use_cache: bool,
              quantization: str) -> LoadedModel:
    """load_model(..., quantization="fp8"): the FP8 cache entry, or quantize on load."""
    from jaxinfer.models.params import FP8_PROJECTIONS
    from jaxinfer.quantization import fp8_scheme, quantize_params_fp8

    if quantization != "fp8":
        raise CheckpointError(f"quantization must be None or 'fp8', got {quantization!r}")
    if use_cache and not model.startswith("dummy:"):
        kind, path = _resolve(model)
        if kind == "gguf":
            cached, state, why = cache_state(path, scheme=fp8_scheme())
            if state == "ok":
                return load_converted(cached, dtype)
            if state in ("damaged", "stale"):  # quantized on load instead
                warnings.warn(f"the FP8 converted copy {cached} is {state} ({why}); not "
                              "used (`jaxinfer convert --quantization fp8` re-makes it)",
                              stacklevel=2)
    if model.startswith("dummy:"):  # random FP8 weights made as FP8: no bf16 copy first
        return _load_dummy_like(model.removeprefix("dummy:"), dtype, fp8=FP8_PROJECTIONS)
    loaded = load_model(model, dtype="float32", progress=progress, use_cache=use_cache)
    if loaded.quantization is None:  # FP8 checkpoints come as they are (float parts too)
        loaded.params = quantize_params_fp8(loaded.params, FP8_PROJECTIONS)
    if dtype != "float32":
        loaded.params = cast_params(loaded.params, dtype)
    return loaded


def read_header(model: str) -> tuple[ModelConfig, Tokenizer | None]:
    """(config, tokenizer or None) of a named model, GGUF file, HF or converted directory,
    without reading its weights. Raises CheckpointError as :func:`load_model` does."""
    kind, path = _resolve(model)
    if kind == "converted":
        return read_converted_header(path)
    if kind == "hf":
        return read_hf_header(path)
    try:
        from jaxinfer.loading.gguf_loader import read_gguf_header
    except ImportError as e:
        raise CheckpointError(f"reading {path} needs the gguf package (pip install 'gguf>=0.17'):"
                              f" {e}") from e
    _reader, cfg, tokenizer = read_gguf_header(path)
    return cfg, tokenizer


def dummy_header(name: str) -> tuple[ModelConfig, Tokenizer | None]:
    """(config, tokenizer) behind ``dummy:<name>``: a named dummy shape (no tokenizer) or the
    config and tokenizer of model source ``name``. Raises CheckpointError for neither."""
    if name in DUMMY_CONFIGS:
        return DUMMY_CONFIGS[name], None
    try:
        return read_header(name)
    except CheckpointError as e:
        raise CheckpointError(f"dummy:{name}: not a dummy shape (known: "
                              f"{', '.join('dummy:' + k for k in DUMMY_CONFIGS)}) nor a model "
                              f"whose config can be read: {e}") from e


def _load_dummy_like(name: str, dtype: str, fp8: Iterable[str] = ()) -> LoadedModel:
    """Random weights at a named dummy shape, or at the shape of model source ``name``
    (``fp8``: projections made as FP8, see :func:`.dummy.dummy_params`)."""
    if name in DUMMY_CONFIGS:
        return load_dummy(name, dtype, fp8=fp8)
    cfg, tokenizer = dummy_header(name)
    return LoadedModel(config=cfg, params=dummy_params(cfg, dtype, fp8=fp8),
                       tokenizer=tokenizer, source=f"dummy:{name}")


def convert(model: str, output: str | None = None, progress: bool = True,
            quantization: str | None = None, calibration: str | Path | None = None,
            calibration_tokens: int = 4096) -> Path:
    """Convert a GGUF file, named model or HF directory into an orbax checkpoint directory.

    ``output`` defaults to the checkpoint cache entry for a GGUF source (where ``load_model``
    looks); it is required for HF directories. ``quantization="fp8"`` stores the projections
    quantized as ``load_model(..., quantization="fp8")`` quantizes them (same bits), with
    the scheme in the manifest and, for the cache entry, in its key. HF checkpoints that carry
    FP8 weights are stored in FP8 either way.

    ``calibration`` (a UTF-8 text file; needs ``quantization="fp8"`` and ``output``): the
    same format and scales, each e4m3 value chosen by GPTQ on the first
    ``calibration_tokens`` tokens of the file in windows of 512
    (jaxinfer.quantization_gptq.quantize_model_gptq); the manifest's scheme names GPTQ and
    the file's SHA-256. Load the result with ``LLM(output)``.

    Returns the directory. Raises CheckpointError if ``output`` is empty, or exists and is
    not a converted checkpoint, for a calibration file that is unreadable or shorter than 2
    tokens, for a model without a tokenizer or already in FP8, or for any loading error.
    """
    from jaxinfer.models.params import FP8_PROJECTIONS
    from jaxinfer.quantization import fp8_scheme, quantize_params_fp8

    if model.startswith("dummy:"):
        raise CheckpointError("dummy weights are generated on the fly; nothing to convert")
    if output is not None and not str(output).strip():  # Path("") is "." (the cwd)
        raise CheckpointError(f"output must name a new directory, got {str(output)!r}")
    kind, path = _resolve(model)
    if kind == "converted":
        raise CheckpointError(f"{path} is already a converted checkpoint")
    if quantization not in (None, "fp8"):
        raise CheckpointError(f"quantization must be None or 'fp8', got {quantization!r}")
    scheme = fp8_scheme() if quantization else None
    calib_path = None
    if calibration is not None:
        if quantization != "fp8":
            raise CheckpointError("a calibration file (GPTQ) needs quantization 'fp8' "
                                  "(--quantization fp8)")
        if output is None:
            raise CheckpointError("a calibration file (GPTQ) needs an output directory "
                                  "(--output DIR)")
        if calibration_tokens < 2:
            raise CheckpointError(f"calibration_tokens (--calibration-tokens) must be at "
                                  f"least 2, got {calibration_tokens}")
        calib_path = _read_calibration(Path(calibration))  # before the model loads
    replace = None
    if output is None:
        if kind == "hf":
            raise CheckpointError(f"give an output directory to convert HF directory {path}")
        output_path, state, why = cache_state(path, scheme=scheme)
        if state == "ok":
            return output_path
        if state == "foreign":  # before the model is read: it could not be written there
            raise CheckpointError(f"the cache entry {output_path} is not a usable converted "
                                  f"copy ({why}) and is left alone: remove it, or give an "
                                  f"output directory")
        replace = _remake(output_path, state, why, path, scheme)
        check_can_create(output_path, "the checkpoint cache entry", "; set "
                         "$JAXINFER_CHECKPOINT_DIR to a writable folder or give --output")
    else:
        output_path = Path(output).expanduser()
        if output_path.exists():
            raise CheckpointError(f"output {output_path} already exists")
        parent = next((p for p in output_path.absolute().parents if p.exists()), None)
        if parent is not None and not parent.is_dir():
            raise CheckpointError(f"output {output_path}: {parent} is not a directory")
        check_can_create(output_path, "output")
    loaded = _load_gguf(path, progress) if kind == "gguf" else load_hf(path, "float32", progress)
    if calib_path is not None:
        scheme = _quantize_gptq(loaded, calib_path, calibration_tokens, progress)
    elif quantization and loaded.quantization is None:  # as load_model(quantization="fp8")
        loaded.params = quantize_params_fp8(loaded.params, FP8_PROJECTIONS)
    else:
        scheme = None  # not quantized here: float, or FP8 as the checkpoint carries it
    return save_converted(output_path, loaded, source=path if kind == "gguf" else None,
                          scheme=scheme, replace=replace)


_CALIB_HEAD_BYTES = 1 << 16  # checked before the model loads


def _read_calibration(path: Path) -> Path:
    """``path`` once its first bytes are checked. Raises CheckpointError when it is
    missing, not a file, unreadable, not UTF-8 (in its first 64 KiB) or empty. Only a
    prefix is read: a corpus of gigabytes (or /dev/zero) is not loaded."""
    try:
        with open(path, "rb") as f:
            head = f.read(_CALIB_HEAD_BYTES)
            more = bool(f.read(1))
        text = codecs.getincrementaldecoder("utf-8")().decode(head, final=not more)
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"calibration file {path}: {e}") from None
    if not more and not text.strip():
        raise CheckpointError(f"calibration file {path} is empty")
    return path


def _calibration_ids(path: Path, tokenizer: Tokenizer,
                     max_tokens: int) -> tuple[list[int], str, int]:
    """(the first ``max_tokens`` token ids of the file's text, sha256 of the bytes read, bytes
    read): the file is read in growing prefixes (from 8 bytes a token wanted, x4 each time)
    until they encode to more than ``max_tokens`` tokens or it ends, so the work and memory
    follow ``max_tokens``, not the file's size. Raises CheckpointError (unreadable, not
    UTF-8)."""
    decoder, digest, text, read = codecs.getincrementaldecoder("utf-8")(), hashlib.sha256(), "", 0
    budget = max(_CALIB_HEAD_BYTES, 8 * max_tokens)
    try:
        with open(path, "rb") as f:
            while True:
                chunk = f.read(budget - read)
                eof = len(chunk) < budget - read
                digest.update(chunk)
                read += len(chunk)
                text += decoder.decode(chunk, final=eof)
                ids = tokenizer.encode(text)
                if len(ids) > max_tokens or eof:  # past the cut: the last token is whole
                    return ids[:max_tokens], digest.hexdigest(), read
                budget *= 4
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"calibration file {path}: {e}") from None


def _quantize_gptq(loaded: LoadedModel, path: Path, max_tokens: int,
                   progress: bool = True, window: int = 512) -> dict:
    """Quantize ``loaded``'s projections in place with GPTQ on the calibration file ``path``
    (:func:`_read_calibration`): its first ``max_tokens`` tokens (:func:`_calibration_ids`)
    in windows of ``window`` (a last window under 2 tokens is dropped); a line per layer
    when ``progress``. Returns the scheme for the manifest. Raises CheckpointError (see
    :func:`convert`)."""
    from jaxinfer.quantization import QuantizationError, fp8_scheme
    from jaxinfer.quantization_gptq import quantize_model_gptq

    if loaded.quantization is not None:
        raise CheckpointError(f"GPTQ needs float weights; this checkpoint's are already "
                              f"{loaded.quantization}")
    if loaded.tokenizer is None:
        raise CheckpointError("GPTQ needs a tokenizer to read the calibration text; this "
                              "checkpoint has none")
    ids, sha256, num_bytes = _calibration_ids(path, loaded.tokenizer, max_tokens)
    windows = [ids[s:s + window] for s in range(0, len(ids), window)]
    windows = [w for w in windows if len(w) >= 2]
    if not windows:
        raise CheckpointError(f"calibration file {path}: {len(ids)} token(s); GPTQ needs at "
                              "least 2")
    used = sum(map(len, windows))
    log = None
    if progress:
        def log(line: str) -> None:
            print(f"GPTQ {line}", file=sys.stderr, flush=True)
    try:
        loaded.params = quantize_model_gptq(loaded, windows, log=log).params
    except QuantizationError as e:
        raise CheckpointError(f"calibration file {path}: {e}") from None
    return {**fp8_scheme(), "rounding": "GPTQ (arXiv 2210.17323; act order, damp 0.01, "
            "block 128), nearest-even, saturating",
            "calibration": {"file": path.name, "sha256": sha256, "bytes_read": num_bytes,
                            "tokens": used, "window": window}}
