"""Shared pieces of the loaders: the error class, the result type and the param builder.

Every loader fills a :class:`ParamBuilder`, which preallocates the stacked ``[L, ...]`` arrays of
:func:`jaxinfer.models.params.param_shapes` once (no per-layer lists that are stacked later, so a
checkpoint never needs twice its size in host memory) and checks each tensor's shape as it
arrives, so a bad checkpoint fails on the first wrong tensor with its source name -- also on
the first tensor holding NaN or infinity (:func:`check_finite`: a corrupt file, e.g. flipped
bytes, would otherwise load and generate garbage).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

import ml_dtypes
import numpy as np

from jaxinfer.config import ModelConfig
from jaxinfer.models.params import (
    FP8_PROJECTIONS,
    WeightError,
    fp8_names,
    fp8_scale_layout,
    param_shapes,
)

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

    @property
    def quantization(self) -> str | None:
        """"fp8" when projections are stored as float8_e4m3fn with ``*_scale`` tensors
        (an FP8 checkpoint, or loaded with ``quantization="fp8"``), else None."""
        return "fp8" if fp8_names(self.params) else None


def np_dtype(dtype: str) -> np.dtype:
    """numpy dtype for ``"float32"`` / ``"bfloat16"``; raises CheckpointError otherwise."""
    if dtype not in DTYPES:
        raise CheckpointError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def cast_params(params: dict[str, np.ndarray], dtype: str) -> dict[str, np.ndarray]:
    """Cast every array to ``dtype`` (no copy for arrays already of that dtype); FP8
    projections and their float32 ``*_scale`` stay as they are."""
    dt = np_dtype(dtype)
    keep = set(fp8_names(params))
    keep |= {k + "_scale" for k in keep}
    return {k: v if v.dtype == dt or k in keep else v.astype(dt) for k, v in params.items()}


# Exponent masks: a float is NaN or infinite exactly when all its exponent bits are set.
_NONFINITE_MASKS = {np.dtype(np.float64): np.uint64(0x7FF0000000000000),
                    np.dtype(np.float32): np.uint32(0x7F800000),
                    np.dtype(np.float16): np.uint16(0x7C00),
                    np.dtype(ml_dtypes.bfloat16): np.uint16(0x7F80),
                    np.dtype(ml_dtypes.float8_e4m3fn): np.uint8(0x7F)}  # no inf; NaN S.1111.111
_UINTS = {8: np.uint64, 4: np.uint32, 2: np.uint16, 1: np.uint8}


def count_nonfinite(a: np.ndarray, chunk: int = 1 << 22) -> int:
    """NaN and infinite elements of ``a`` (float64/32/16, bfloat16, float8_e4m3fn; 0 for
    other dtypes), read from the bit patterns ``chunk`` elements at a time into one reused
    buffer: no float temporaries (ml_dtypes' bfloat16 arithmetic is slow); a chunk is counted
    only when its largest masked value shows a non-finite one (a clean chunk costs one
    ``bitwise_and`` and one ``max``, less than copying it)."""
    mask = _NONFINITE_MASKS.get(a.dtype)
    if mask is None:
        return 0
    bits = np.ascontiguousarray(a).reshape(-1).view(_UINTS[a.dtype.itemsize])
    buf = np.empty(min(chunk, bits.size), bits.dtype)
    n = 0
    for i in range(0, bits.size, chunk):
        part = np.bitwise_and(bits[i:i + chunk], mask, out=buf[:min(chunk, bits.size - i)])
        if part.size and part.max() == mask:
            n += int(np.count_nonzero(part == mask))
    return n


def check_finite(a: np.ndarray, what: str, source: str) -> None:
    """Raise CheckpointError when tensor ``what`` of ``source`` holds NaN or infinity."""
    if n := count_nonfinite(a):
        raise CheckpointError(f"{source}: tensor {what!r} holds {n} NaN or infinite values "
                              f"(of {a.size}): the checkpoint is corrupt (or was saved from a "
                              "model whose weights diverged)")


def split_layer_name(name: str, prefix: str, where: object) -> tuple[int, str]:
    """``(layer, rest)`` of ``<prefix><layer>.<rest>``; CheckpointError naming ``where`` and
    the tensor when the layer index is not a decimal integer or nothing follows it."""
    idx, _, rest = name[len(prefix):].partition(".")
    if not re.fullmatch(r"[0-9]+", idx):
        raise CheckpointError(f"{where}: tensor {name!r}: layer index {idx!r} is not an integer")
    if not rest:
        raise CheckpointError(f"{where}: tensor {name!r}: no parameter name after the layer "
                              f"index (expected {prefix}{idx}.<name>)")
    return int(idx), rest


class ParamBuilder:
    """Collects tensors into the canonical layout, checking names and shapes as they come.

    ``put(name, value, layer=None, source_name=...)`` stores an ``[in, out]``-ordered array
    (``transpose=True``: the checkpoint's ``[out, in]`` array, transposed here) into ``name``
    (a key of ``param_shapes`` such as ``"embed"``, or a per-layer suffix such as ``"wq"``
    with ``layer``). ``finish()`` raises
    :class:`CheckpointError` listing what was never filled. ``put_fp8`` stores a projection
    layer that a checkpoint carries in FP8 (e4m3 ``[in, out]`` + its scale) as it is.
    """

    def __init__(self, cfg: ModelConfig, dtype: str, source: str) -> None:
        self.cfg = cfg
        self.source = source
        self.dtype = np_dtype(dtype)
        self.shapes = param_shapes(cfg)
        self.params = {k: np.empty(s, dtype=self.dtype) for k, s in self.shapes.items()}
        self.filled: dict[str, set[int] | bool] = {}
        self.fp8: dict[str, np.ndarray] = {}  # projection -> e4m3 [L, K, N], filled by layer
        self.fp8_scales: dict[str, dict[int, np.ndarray]] = {}  # -> {layer: [N] or [G, N]}

    def wants(self, name: str) -> bool:
        """Whether ``name`` (a top-level name or a per-layer suffix) is part of the layout."""
        return name in self.shapes or f"layers.{name}" in self.shapes

    def check(self, name: str, shape: tuple[int, ...], layer: int | None,
               what: str, transpose: bool = False, layout: str = "",
               reverse_dims: bool = False) -> str:
        """The params key for ``name``; raises CheckpointError for a bad name/shape/layer.

        ``shape`` is the tensor's shape as the checkpoint stores it, ``transpose`` whether
        the canonical ``[in, out]`` layout is its transpose, ``reverse_dims`` whether the file
        lists dimensions in reverse numpy order (GGUF's ggml ``ne``), ``layout`` how the
        file orders them, for the message (which quotes both shapes in that order)."""
        key = name if layer is None else f"layers.{name}"
        if key not in self.shapes:
            raise CheckpointError(f"{self.source}: tensor {what!r} has no place in a "
                                  f"{self.cfg.family} model with this config")
        if layer is not None and not 0 <= layer < self.cfg.num_layers:  # before the shape:
            # a layer past the last is the plainer fault (its shape may be wrong too)
            raise CheckpointError(f"{self.source}: tensor {what!r} is for layer {layer}, "
                                  f"but the model has {self.cfg.num_layers} layers")
        want = tuple(self.shapes[key] if layer is None else self.shapes[key][1:])
        want_np = want[::-1] if transpose else want  # as a numpy array of the file
        if tuple(shape) != want_np:
            file, exp = (tuple(shape)[::-1], want_np[::-1]) if reverse_dims else (
                tuple(shape), want_np)
            note = f" ({layout})" if layout else ""
            raise CheckpointError(f"{self.source}: tensor {what!r} has shape {file}{note}, "
                                  f"expected {exp} for {key}")
        return key

    def _mark(self, key: str, layer: int | None) -> None:
        if layer is None:
            self.filled[key] = True
        else:
            done = self.filled.setdefault(key, set())
            assert isinstance(done, set)
            done.add(layer)

    def put(self, name: str, value: np.ndarray, layer: int | None = None,
            source_name: str = "", transpose: bool = False, layout: str = "",
            reverse_dims: bool = False) -> None:
        """Store ``value`` (``.T`` of it with ``transpose``: the checkpoint's ``[out, in]``
        projections); shape errors quote the file's layout (see ``check``)."""
        key = self.check(name, value.shape, layer, source_name or name, transpose, layout,
                          reverse_dims)
        if transpose:
            value = value.T
        check_finite(value, source_name or name, self.source)
        if layer is None:
            self.params[key][...] = value
        else:
            self.params[key][layer] = value
        self._mark(key, layer)

    def put_fp8(self, name: str, q: np.ndarray, scale: np.ndarray, layer: int,
                source_name: str = "") -> None:
        """Store layer ``layer`` of projection ``name`` as e4m3 ``q [K, N]`` with float32
        ``scale`` ``[N]`` or ``[G, N]`` (see jaxinfer/models/params.py)."""
        what = source_name or name
        key = self.check(name, q.T.shape, layer, what, transpose=True,
                          layout="[out, in] as stored")
        if key not in FP8_PROJECTIONS:
            raise CheckpointError(f"{self.source}: tensor {what!r} ({key}) cannot be stored "
                                  "in FP8 (only the layers' projections can)")
        try:
            fp8_scale_layout(q.shape, scale.shape)
        except WeightError as e:
            raise CheckpointError(f"{self.source}: tensor {what!r}: {e}") from None
        if key not in self.fp8:
            self.fp8[key] = np.empty(self.shapes[key], dtype=q.dtype)
        self.fp8[key][layer] = q
        self.fp8_scales.setdefault(key, {})[layer] = np.asarray(scale, np.float32)
        self._mark(key, layer)

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
        if any(self.fp8_scales.values()):
            from jaxinfer.loading.fp8_checkpoint import merge_fp8

            merge_fp8(self.params, self.fp8, self.fp8_scales, self.source)
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
