"""Shared pieces of the loaders: the error class, the result type and the param builder.

Every loader fills a :class:`ParamBuilder`, which preallocates the stacked ``[L, ...]`` arrays of
:func:`jaxinfer.models.params.param_shapes` once (no per-layer lists that are stacked later, so a
checkpoint never needs twice its size in host memory) and checks each tensor's shape as it
arrives, so a bad checkpoint fails on the first wrong tensor with its source name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import ml_dtypes
import numpy as np

from jaxinfer.config import ModelConfig
from jaxinfer.models.params import param_shapes

if TYPE_CHECKING:
    from jaxinfer.tokenizer import Tokenizer

DTYPES: dict[str, np.dtype] = {
    "float32": np.dtype(np.float32),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
}


class CheckpointError(ValueError):
    """A checkpoint cannot be found, read or matched to a supported model."""


@dataclass
class LoadedModel:
    """A model ready for the engine.

    Attributes:
      config: the architecture.
      params: exactly the names and shapes of ``param_shapes(config)``; numpy arrays of the
        dtype asked for (float32 or ml_dtypes.bfloat16), projections ``[in, out]``.
      tokenizer: the model's tokenizer, or None (dummy weights, GGUF without a vocabulary).
      source: what was read (a path, or ``dummy:<shape>``), for messages.
    """

    config: ModelConfig
    params: dict[str, np.ndarray]
    tokenizer: Tokenizer | None
    source: str


def np_dtype(dtype: str) -> np.dtype:
    """numpy dtype for ``"float32"`` / ``"bfloat16"``; raises CheckpointError otherwise."""
    if dtype not in DTYPES:
        raise CheckpointError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def cast_params(params: dict[str, np.ndarray], dtype: str) -> dict[str, np.ndarray]:
    """Cast every array to ``dtype`` (no copy for arrays already of that dtype)."""
    dt = np_dtype(dtype)
    return {k: v if v.dtype == dt else v.astype(dt) for k, v in params.items()}


class ParamBuilder:
    """Collects tensors into the canonical layout, checking names and shapes as they come.

    ``put(name, value, layer=None, source_name=...)`` stores an ``[in, out]``-ordered array
    (already transposed by the caller) into ``name`` (a key of ``param_shapes`` such as
    ``"embed"``, or a per-layer suffix such as ``"wq"`` with ``layer``). ``finish()`` raises
    :class:`CheckpointError` listing what was never filled.
    """

    def __init__(self, cfg: ModelConfig, dtype: str, source: str) -> None:
        self.cfg = cfg
        self.source = source
        self.dtype = np_dtype(dtype)
        self.shapes = param_shapes(cfg)
        self.params = {k: np.empty(s, dtype=self.dtype) for k, s in self.shapes.items()}
        self.filled: dict[str, set[int] | bool] = {}

    def wants(self, name: str) -> bool:
        """Whether ``name`` (a top-level name or a per-layer suffix) is part of the layout."""
        return name in self.shapes or f"layers.{name}" in self.shapes

    def put(self, name: str, value: np.ndarray, layer: int | None = None,
            source_name: str = "") -> None:
        key = name if layer is None else f"layers.{name}"
        what = source_name or key
        if key not in self.shapes:
            raise CheckpointError(f"{self.source}: tensor {what!r} has no place in a "
                                  f"{self.cfg.family} model with this config")
        want = self.shapes[key] if layer is None else self.shapes[key][1:]
        if tuple(value.shape) != tuple(want):
            raise CheckpointError(f"{self.source}: tensor {what!r} has shape "
                                  f"{tuple(value.shape)}, expected {tuple(want)} for {key}")
        if layer is None:
            self.params[key][...] = value
            self.filled[key] = True
        else:
            if not 0 <= layer < self.cfg.num_layers:
                raise CheckpointError(f"{self.source}: tensor {what!r} is for layer {layer}, "
                                      f"but the model has {self.cfg.num_layers} layers")
            self.params[key][layer] = value
            done = self.filled.setdefault(key, set())
            assert isinstance(done, set)
            done.add(layer)

    def finish(self) -> dict[str, np.ndarray]:
        missing: list[str] = []
        for key in self.shapes:
            got = self.filled.get(key)
            if key.startswith("layers."):
                have = got if isinstance(got, set) else set()
                lost = [i for i in range(self.cfg.num_layers) if i not in have]
                if lost:
                    missing.append(f"{key} (layers {_ranges(lost)})")
            elif not got:
                missing.append(key)
        if missing:
            raise CheckpointError(f"{self.source}: missing tensors: {', '.join(missing)}")
        return self.params


def _ranges(idx: list[int]) -> str:
    """``[0,1,2,5]`` -> ``"0-2, 5"``."""
    out: list[str] = []
    start = prev = idx[0]
    for i in idx[1:] + [None]:  # type: ignore[list-item]
        if i is not None and i == prev + 1:
            prev = i
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if i is not None:
            start = prev = i
    return ", ".join(out)
