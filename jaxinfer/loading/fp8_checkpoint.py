"""HF checkpoints that already carry FP8 weights: their formats, read into the engine's layout.

Supported (``quantization_config`` in ``config.json``; the weight tensors are
``F8_E4M3`` ``[out, in]``, ``w ≈ weight * scale``):

* ``"quant_method": "fp8"`` (vLLM / AutoFP8 / transformers' FineGrainedFP8): a per-tensor
  ``weight_scale`` (``[]`` or ``[1]``; one per projection, vLLM's serialized format), or a
  per-channel one (``[out]`` or ``[out, 1]``); with ``"weight_block_size": [bn, bk]``
  (DeepSeek-V3 / Qwen3-FP8) a ``weight_scale_inv`` of ``[ceil(out/bn), ceil(in/bk)]`` blocks
  (the name notwithstanding, a multiplier, as vLLM applies it).
* ``"quant_method": "compressed-tensors"`` with ``"format": "float-quantized"`` and 8-bit
  symmetric ``"type": "float"`` weights (llm-compressor FP8 / FP8-dynamic / FP8-block):
  ``weight_scale`` per tensor (``[1]``), per channel (``[out, 1]``), per group
  (``[out, in / group_size]``) or per block (``[ceil(out/bn), ceil(in/bk)]``).

Into the engine layout (jaxinfer/models/params.py) scales go without loss: per-tensor
scales are repeated over the output channels; block scales become one scale per output
channel when every block of a row of blocks has the same scale, otherwise per-group scales
``[in / bk, out]`` (a block's scale repeated over its ``bn`` output channels), which needs
``in % bk == 0``. Activation settings are not applied: the engine runs W8A16 (bf16
activations), so a static ``input_scale`` is checked and then ignored, as vLLM's
``CompressedTensorsW8A16Fp8`` does; weights are used bit for bit. Not supported, with an
error naming the file and tensor or config key: e5m2 or 4-bit float weights, integer
(GPTQ/AWQ/int8) schemes, asymmetric weights, a ``kv_cache_scheme``, block sizes that do not
tile the input dimension with unequal block scales, non-finite or non-positive scales,
NaN weights.

safetensors' numpy API cannot hold float8 (numpy has no such dtype), so e4m3 tensors are
read here from the file's header offsets and viewed as ``ml_dtypes.float8_e4m3fn``.
"""

from __future__ import annotations

import json
import math
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from jaxinfer.loading.base import CheckpointError
from jaxinfer.models.params import FP8_PROJECTIONS

F8 = np.dtype(ml_dtypes.float8_e4m3fn)
FP8_DTYPE = "F8_E4M3"  # safetensors dtype tag
SCALE_SUFFIXES = ("weight_scale", "weight_scale_inv")
IGNORED_SUFFIXES = ("input_scale",)  # static activation scales: checked, not applied (W8A16)
# Projections that read one input: the model may run them as one GEMM, so they share FP8-ness
# and scale layout.
SHARED_INPUT = (("layers.wq", "layers.wk", "layers.wv"), ("layers.w_gate", "layers.w_up"))


@dataclass(frozen=True)
class Fp8Format:
    """What a checkpoint's ``quantization_config`` allows.

    Attributes:
      method: "fp8" or "compressed-tensors".
      strategies: scale layouts allowed: subset of {"tensor", "channel", "group", "block"}.
      block: (bn, bk) rows x columns of a scale block in the ``[out, in]`` weight, if any.
      group: input columns per scale for the "group" strategy, if any.
    """

    method: str
    strategies: frozenset[str]
    block: tuple[int, int] | None = None
    group: int | None = None


def _block(value: Any, where: str) -> tuple[int, int]:
    """``[128, 128]`` or ``"128x128"`` -> (128, 128)."""
    if isinstance(value, str):
        value = value.lower().split("x")
    try:
        bn, bk = (int(v) for v in value)
    except (TypeError, ValueError):
        raise CheckpointError(f"{where}: block size {value!r} is not two integers") from None
    if bn <= 0 or bk <= 0:
        raise CheckpointError(f"{where}: block size {value!r} must be positive")
    return bn, bk


def _compressed_tensors(qc: dict[str, Any], where: str) -> Fp8Format:
    if qc.get("kv_cache_scheme"):
        raise CheckpointError(f"{where}: kv_cache_scheme (FP8 KV-cache scales) is not supported")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise CheckpointError(f"{where}: compressed-tensors config has no config_groups")
    strategies: set[str] = set()
    block = group = None
    for gname, g in groups.items():
        at = f"{where}.config_groups.{gname}"
        fmt = g.get("format") or qc.get("format")
        if fmt != "float-quantized":
            raise CheckpointError(f"{at}: format {fmt!r} is not supported (only "
                                  "'float-quantized': FP8 weights stored as float8_e4m3fn)")
        w = g.get("weights")
        if not isinstance(w, dict):
            raise CheckpointError(f"{at}: no weights scheme")
        if w.get("type", "int") != "float" or w.get("num_bits", 8) != 8:
            raise CheckpointError(f"{at}.weights: {w.get('num_bits', 8)}-bit "
                                  f"{w.get('type', 'int')} weights are not supported (only "
                                  "8-bit float, e4m3)")
        if not w.get("symmetric", True):
            raise CheckpointError(f"{at}.weights: asymmetric FP8 weights are not supported")
        if w.get("dynamic"):
            raise CheckpointError(f"{at}.weights: dynamic weight quantization is not supported")
        if g.get("output_activations"):
            raise CheckpointError(f"{at}: output_activations quantization is not supported")
        strategy = w.get("strategy")
        gs = w.get("group_size")
        if strategy is None:  # compressed-tensors' inference from group_size
            strategy = "tensor" if gs is None else "channel" if gs == -1 else "group"
        if strategy not in ("tensor", "channel", "group", "block"):
            raise CheckpointError(f"{at}.weights: strategy {strategy!r} is not supported")
        if strategy == "group":
            if not isinstance(gs, int) or gs <= 0:
                raise CheckpointError(f"{at}.weights: group strategy needs a positive "
                                      f"group_size, got {gs!r}")
            if group not in (None, gs):
                raise CheckpointError(f"{where}: config groups use different group sizes")
            group = gs
        if strategy == "block":
            b = _block(w.get("block_structure"), f"{at}.weights.block_structure")
            if block not in (None, b):
                raise CheckpointError(f"{where}: config groups use different block sizes")
            block = b
        strategies.add(strategy)
    return Fp8Format("compressed-tensors", frozenset(strategies), block, group)


def parse_quantization_config(raw: dict[str, Any], source: str) -> Fp8Format | None:
    """The FP8 format of a parsed ``config.json``; None when it has no quantization_config.

    Raises CheckpointError naming the key for any method or setting not supported (see the
    module docstring).
    """
    qc = raw.get("quantization_config")
    if qc is None:
        return None
    where = f"{source}/config.json quantization_config"
    if not isinstance(qc, dict):
        raise CheckpointError(f"{where} is not an object")
    method = qc.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors(qc, where)
    if method != "fp8":
        raise CheckpointError(f"{where}: quant_method {method!r} is not supported (supported: "
                              "'fp8', 'compressed-tensors' with float-quantized FP8 weights)")
    if qc.get("fmt", "e4m3") != "e4m3":
        raise CheckpointError(f"{where}: fmt {qc.get('fmt')!r} is not supported (only e4m3)")
    if qc.get("weight_block_size") is not None:
        return Fp8Format("fp8", frozenset({"block"}),
                         _block(qc["weight_block_size"], f"{where}.weight_block_size"))
    return Fp8Format("fp8", frozenset({"tensor", "channel"}))


class Fp8TensorReader:
    """Reads ``F8_E4M3`` tensors of safetensors files (header offsets, ``np.memmap``)."""

    def __init__(self) -> None:
        self._headers: dict[Path, tuple[int, dict[str, Any]]] = {}

    def _header(self, path: Path) -> tuple[int, dict[str, Any]]:
        if path not in self._headers:
            try:
                with open(path, "rb") as f:
                    (n,) = struct.unpack("<Q", f.read(8))
                    self._headers[path] = (8 + n, json.loads(f.read(n)))
            except (OSError, struct.error, ValueError) as e:
                raise CheckpointError(f"cannot read the safetensors header of {path}: {e}") \
                    from e
        return self._headers[path]

    def read(self, path: Path, name: str) -> np.ndarray:
        """Tensor ``name`` of ``path`` as float8_e4m3fn (a read-only memory map)."""
        start, header = self._header(path)
        info = header.get(name)
        if not isinstance(info, dict) or info.get("dtype") != FP8_DTYPE:
            raise CheckpointError(f"{path}: tensor {name!r} is not an {FP8_DTYPE} tensor")
        shape = tuple(info["shape"])
        lo, hi = info["data_offsets"]
        if hi - lo != math.prod(shape):
            raise CheckpointError(f"{path}: tensor {name!r} has {hi - lo} bytes for shape "
                                  f"{shape}")
        try:
            raw = np.memmap(path, dtype=np.uint8, mode="r", offset=start + lo, shape=(hi - lo,))
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{path}: cannot read tensor {name!r} (truncated?): {e}") \
                from e
        if np.any((raw & 0x7F) == 0x7F):  # e4m3fn NaN: S.1111.111
            raise CheckpointError(f"{path}: FP8 tensor {name!r} holds NaN values")
        return raw.view(F8).reshape(shape)


def _positive(scale: np.ndarray, what: str) -> np.ndarray:
    s = np.asarray(scale, np.float32)
    if not np.all(np.isfinite(s)) or not np.all(s > 0):
        bad = s[~(np.isfinite(s) & (s > 0))].ravel()[:3].tolist()
        raise CheckpointError(f"{what} must hold finite positive values, has {bad}")
    return s


def check_input_scale(scale: np.ndarray, what: str) -> None:
    """A static activation scale: one finite positive value (then ignored: W8A16)."""
    if scale.size != 1:
        raise CheckpointError(f"{what} has shape {tuple(scale.shape)}, expected one value")
    _positive(scale, what)


def to_engine(q: np.ndarray, scale: np.ndarray, fmt: Fp8Format, what: str
              ) -> tuple[np.ndarray, np.ndarray]:
    """HF ``weight [N, K]`` e4m3 + its scale -> (``[K, N]`` e4m3, ``[N]`` or ``[K/g, N]`` f32).

    ``what`` names the scale tensor and file for errors (CheckpointError: a scale shape the
    format does not allow, non-finite or non-positive scales, untileable block scales).
    """
    N, K = q.shape
    s = _positive(scale, what)
    shapes = []
    if "tensor" in fmt.strategies:
        shapes.append("[] or [1] (per tensor)")
        if s.size == 1 and s.ndim <= 1:
            return q.T, np.full(N, s.reshape(()), np.float32)
    if "channel" in fmt.strategies:
        shapes.append(f"[{N}] or [{N}, 1] (per channel)")
        if s.shape in ((N,), (N, 1)):
            return q.T, s.reshape(N)
    if fmt.group is not None:
        g = fmt.group
        shapes.append(f"[{N}, {-(-K // g)}] (groups of {g})")
        if s.shape == (N, -(-K // g)):
            return q.T, _columns(s, g, 1, K, N, what)
    if fmt.block is not None:
        bn, bk = fmt.block
        shapes.append(f"[{-(-N // bn)}, {-(-K // bk)}] (blocks of {bn}x{bk})")
        if s.shape == (-(-N // bn), -(-K // bk)):
            return q.T, _columns(s, bk, bn, K, N, what)
    raise CheckpointError(f"{what} has shape {tuple(s.shape)}; the checkpoint's "
                          f"{fmt.method} format expects {' or '.join(shapes)} for a weight of "
                          f"shape [{N}, {K}]")


def _columns(s: np.ndarray, bk: int, bn: int, K: int, N: int, what: str) -> np.ndarray:
    """Scales ``[ceil(N/bn), ceil(K/bk)]`` of blocks -> engine ``[N]`` or ``[K/bk, N]``."""
    per_out = np.repeat(s, bn, axis=0)[:N]  # [N, ceil(K/bk)]
    if np.all(per_out == per_out[:, :1]):
        return per_out[:, 0].copy()  # equal along K: one scale per output channel
    if K % bk:
        raise CheckpointError(f"{what}: blocks of {bk} input columns do not tile K={K} and "
                              "the block scales differ along K; not supported")
    return np.ascontiguousarray(per_out.T)


def merge_fp8(params: dict[str, np.ndarray], fp8: dict[str, np.ndarray],
              scales: dict[str, dict[int, np.ndarray]], source: str) -> None:
    """Put the FP8 layers a loader collected into ``params`` (float arrays, in place).

    A projection whose every layer is FP8 becomes e4m3 ``[L, K, N]`` + ``<name>_scale``;
    one with FP8 and float layers is dequantized to float (exact; warns), and so are FP8
    projections that share their input with float ones (:data:`SHARED_INPUT`: the model may
    fuse them into one GEMM). Per-channel scales of a projection that also has per-group
    ones are repeated over the groups (exact).
    """
    full = {k for k, by_layer in scales.items()
            if by_layer and len(by_layer) == fp8[k].shape[0]}
    for k in sorted(set(scales) - full):
        if scales[k]:
            warnings.warn(f"{source}: {k} is FP8 in layers {sorted(scales[k])} only; those "
                          "layers are dequantized", stacklevel=3)
    for group in SHARED_INPUT:
        present = [k for k in group if k in params]
        if any(k in full for k in present) and not all(k in full for k in present):
            warnings.warn(f"{source}: {', '.join(present)} mix FP8 and float weights; the FP8 "
                          "ones are dequantized", stacklevel=3)
            full -= set(present)
    for k, by_layer in scales.items():
        if k in full:
            continue
        for i, s in by_layer.items():  # dequantize into the float array
            params[k][i] = dequantize(fp8[k][i], s).astype(params[k].dtype)
    units: list[tuple[str, ...]] = [*SHARED_INPUT, *((k,) for k in FP8_PROJECTIONS)]
    for unit in units:  # fused partners first, then the rest one by one
        members = [k for k in unit if k in full]
        counts = {s.shape[0] for k in members for s in scales[k].values() if s.ndim == 2}
        if len(counts) > 1:
            raise CheckpointError(f"{source}: {', '.join(members)} use different numbers of "
                                  f"scale groups {sorted(counts)}; not supported")
        for k in members:
            n = fp8[k].shape[-1]
            G = next(iter(counts), None)  # repeat per-channel scales over the groups
            params[k] = fp8[k]
            params[k + "_scale"] = np.stack([
                s if G is None or s.ndim == 2 else np.broadcast_to(s, (G, n))
                for _, s in sorted(scales[k].items())]).astype(np.float32)
            full.discard(k)


def dequantize(q: np.ndarray, s: np.ndarray) -> np.ndarray:
    """float32 ``[K, N]`` from e4m3 ``[K, N]`` and ``[N]`` or ``[G, N]`` scales."""
    import jax.numpy as jnp

    from jaxinfer.quantization import dequantize_fp8_weight

    return np.asarray(dequantize_fp8_weight(jnp.asarray(q), jnp.asarray(s)))


class Fp8Weights:
    """Reads a checkpoint's FP8 weights with their scales, and tracks which scale tensors
    were used (every scale must belong to an FP8 weight)."""

    def __init__(self, fmt: Fp8Format | None, weight_map: dict[str, Path], source: str):
        self.fmt, self.wm, self.source = fmt, weight_map, source
        self.reader = Fp8TensorReader()
        self.used: set[str] = set()

    @staticmethod
    def is_scale(name: str) -> bool:
        return name.rsplit(".", 1)[-1] in SCALE_SUFFIXES + IGNORED_SUFFIXES

    def skip(self, weight: str) -> None:
        """``weight`` is not used (a tied LM head): neither are its scales."""
        prefix = weight.removesuffix("weight")
        self.used |= {prefix + s for s in SCALE_SUFFIXES + IGNORED_SUFFIXES}

    def _tensor(self, name: str) -> np.ndarray:
        from safetensors import safe_open

        path = self.wm[name]
        try:
            with safe_open(str(path), framework="np") as f:
                return np.asarray(f.get_tensor(name), np.float32)
        except Exception as e:  # SafetensorError, missing key, F8 scales
            raise CheckpointError(f"{path}: cannot read tensor {name!r}: {e}") from e

    def read(self, path: Path, name: str, dtype: str) -> tuple[np.ndarray, np.ndarray]:
        """FP8 weight ``name`` (safetensors dtype ``dtype``) of ``path`` in engine layout:
        (``[K, N]`` e4m3, ``[N]`` or ``[K/g, N]`` float32)."""
        if dtype != FP8_DTYPE:
            raise CheckpointError(f"{path}: tensor {name!r} is {dtype}; only {FP8_DTYPE} "
                                  "(e4m3) FP8 weights are supported")
        if self.fmt is None:
            raise CheckpointError(f"{path}: tensor {name!r} is {dtype} but {self.source}/"
                                  "config.json has no quantization_config")
        prefix = name.removesuffix("weight")
        found = [prefix + s for s in SCALE_SUFFIXES if prefix + s in self.wm]
        if len(found) != 1:
            raise CheckpointError(f"{path}: FP8 tensor {name!r} has "
                                  + ("both " + " and ".join(found) if found else "no " + " or "
                                     .join(prefix + s for s in SCALE_SUFFIXES)))
        scale_name = found[0]
        q = self.reader.read(path, name)
        if q.ndim != 2:
            raise CheckpointError(f"{path}: FP8 tensor {name!r} has shape {q.shape}, "
                                  "expected [out, in]")
        self.used.add(scale_name)
        input_scale = prefix + IGNORED_SUFFIXES[0]
        if input_scale in self.wm:
            check_input_scale(self._tensor(input_scale),
                              f"{self.wm[input_scale]}: tensor {input_scale!r}")
            self.used.add(input_scale)
        return to_engine(q, self._tensor(scale_name), self.fmt,
                         f"{self.wm[scale_name]}: tensor {scale_name!r}")

    def check_all_used(self) -> None:
        """Raise CheckpointError for a scale tensor without an FP8 weight."""
        unused = sorted(k for k in self.wm if self.is_scale(k) and k not in self.used)
        if unused:
            raise CheckpointError(f"{self.wm[unused[0]]}: scale tensor {unused[0]!r} belongs "
                                  "to no FP8 weight" + (f" ({len(unused) - 1} more)"
                                                       if len(unused) > 1 else ""))
