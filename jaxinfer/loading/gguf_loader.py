"""GGUF checkpoints (llama.cpp format) -> ModelConfig + canonical params.

Reads with ``gguf.GGUFReader`` and dequantizes every block type with ``gguf.quants.dequantize``
(Q4_0/1, Q5_0/1, Q8_0, K-quants, F16, BF16, F32 ...). Two llama.cpp conventions are undone:

* ``llama``-architecture files store the Q and K projection rows permuted for llama.cpp's
  interleaved RoPE (``permute`` in llama.cpp's convert_hf_to_gguf.py); they are permuted back as
  HF transformers does (``LlamaTensorProcessor._reverse_permute_weights`` in
  transformers/modeling_gguf_pytorch_utils.py), with ``n_head`` for Q and ``n_head_kv`` for K.
* ggml matrices come out ``[out, in]``; the canonical layout is ``[in, out]``.

Gemma 3 facts the GGUF omits come from the reference config (HF ``Gemma3TextConfig``, llama.cpp
``src/models/gemma3.cpp``): local RoPE base 1e4, every 6th layer global, query scaling
1/sqrt(head_dim) (1/sqrt(hidden/heads) for the 62-layer 27B), embeddings scaled by
sqrt(hidden), GELU-tanh, Q/K and post norms. Its norm weights already include Gemma's "+1".
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf.quants import dequantize
from tqdm.auto import tqdm

from jaxinfer.config import ConfigError, ModelConfig, check_positive_int, check_positive_number
from jaxinfer.loading.base import CheckpointError, LoadedModel, ParamBuilder, split_layer_name
from jaxinfer.sampling_defaults import GGUF_SAMPLING_KEYS, from_generation_config
from jaxinfer.tokenizer import Tokenizer, TokenizerError

SUPPORTED_GGUF_ARCHS = ("llama", "gemma3")

# blk.N.<name>.weight / .bias -> (canonical per-layer name, transpose)
_LAYER_TENSORS: dict[str, tuple[str, bool]] = {
    "attn_norm.weight": ("attn_norm", False),
    "attn_q.weight": ("wq", True),
    "attn_k.weight": ("wk", True),
    "attn_v.weight": ("wv", True),
    "attn_output.weight": ("wo", True),
    "attn_q.bias": ("bq", False),
    "attn_k.bias": ("bk", False),
    "attn_v.bias": ("bv", False),
    "attn_q_norm.weight": ("q_norm", False),
    "attn_k_norm.weight": ("k_norm", False),
    "ffn_norm.weight": ("ffn_norm", False),  # llama: post_attention_layernorm; gemma3: pre-FFN
    "post_attention_norm.weight": ("post_attn_norm", False),
    "post_ffw_norm.weight": ("post_ffn_norm", False),
    "ffn_gate.weight": ("w_gate", True),
    "ffn_up.weight": ("w_up", True),
    "ffn_down.weight": ("w_down", True),
}
# ggml tensor types that hold integers, never float weights.
_INT_TYPES = ("I8", "I16", "I32", "I64")
_TOP_TENSORS: dict[str, tuple[str, bool]] = {
    "token_embd.weight": ("embed", False),
    "output_norm.weight": ("final_norm", False),
    "output.weight": ("lm_head", True),
}


def open_gguf(path: str | Path) -> gguf.GGUFReader:
    """Open a GGUF file, turning every failure into a CheckpointError that names the file.

    Also checks that every tensor's bytes lie inside the file, so a truncated download fails
    here rather than as a shape error later.
    """
    p = Path(path)
    if not p.is_file():
        raise CheckpointError(f"GGUF file {p} does not exist")
    size = p.stat().st_size
    try:
        reader = gguf.GGUFReader(str(p))
    except Exception as e:  # the reader raises ValueError, IndexError, struct errors ...
        raise CheckpointError(_why_unreadable(p, size, e)) from e
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size or t.data.nbytes != t.n_bytes:
            raise CheckpointError(f"GGUF file {p} is truncated: tensor {t.name!r} needs bytes "
                                  f"up to {t.data_offset + t.n_bytes}, file has {size}")
    return reader


class _HeaderReader(gguf.GGUFReader):
    """A GGUF's header only: each tensor's name and byte range ``extents``, its data not
    mapped (so a file cut inside the tensor data still parses; ``open_gguf`` uses it to say
    what a truncated file lacks). Overrides the reader's tensor-building step."""

    def _build_tensors(self, start_offs: int, fields: list[Any]) -> None:
        self.extents: list[tuple[str, int, int]] = []
        for f in fields:
            _, name, _, dims, raw_dtype, offset = f.parts
            block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(int(raw_dtype[0]))]
            start = int(start_offs + offset[0])
            end = start + int(np.prod(dims)) * type_size // block
            self.extents.append((bytes(name).decode("utf-8", "replace"), start, end))


def _why_unreadable(p: Path, size: int, err: Exception) -> str:
    """The message for a GGUF file the reader failed on (``err``): which tensors a file cut
    inside the tensor data lacks, else that the header is cut or corrupt."""
    detail = f"{type(err).__name__}: {err}"
    try:
        extents = _HeaderReader(str(p)).extents
    except Exception:
        return (f"cannot read GGUF file {p} ({size} bytes): its header (metadata and tensor "
                f"table) is truncated or corrupt; is it a whole GGUF file? (the gguf "
                f"reader's error: {detail})")
    cut = sorted((start, name, end) for name, start, end in extents if end > size)
    if not cut:
        return f"cannot read GGUF file {p} (corrupt?): {detail}"
    start, name, end = cut[0]
    need = max(e for _, _, e in cut)
    return (f"GGUF file {p} is truncated: it has {size} bytes, its tensor data needs {need}; "
            f"{len(cut)} of {len(extents)} tensors are cut off, from {name!r} (bytes "
            f"{start}..{end}) on (re-download or re-convert the file)")


def _field(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    v = f.contents()
    if f.types and f.types[0] == gguf.GGUFValueType.FLOAT32:
        v = float(str(np.float32(v)))  # shortest decimal of the float32: 1e-05, not 9.99e-06
    return v


_REQUIRED = object()


def _typed(reader: gguf.GGUFReader, key: str, source: str, kind: str,
           default: Any = _REQUIRED) -> Any:
    """Metadata ``key`` as an int (``kind="int"``) or a float (``"float"``), ``default`` when
    absent; CheckpointError naming the key when it is required and absent, per-layer (a
    list), or of another type (a string, a bool ...)."""
    v = _field(reader, key)
    if v is None:
        if default is _REQUIRED:
            raise CheckpointError(f"{source}: GGUF metadata lacks {key}")
        return default
    if isinstance(v, list):
        raise CheckpointError(f"{source}: per-layer {key} is not supported")
    ok = (int,) if kind == "int" else (int, float)
    if isinstance(v, bool) or not isinstance(v, ok):
        raise CheckpointError(f"{source}: GGUF metadata {key} is {v!r}, expected "
                              f"{'an integer' if kind == 'int' else 'a number'}")
    return v if kind == "int" else float(v)


def sampling_defaults_of(reader: gguf.GGUFReader) -> dict[str, Any]:
    """The default sampling params a GGUF's ``general.sampling.*`` metadata sets
    (:data:`~jaxinfer.sampling_defaults.GGUF_SAMPLING_KEYS`), unchecked as a
    generation_config.json's are: a value of the wrong type loads, and is refused naming
    its key only where the defaults apply (``check_sampling_defaults``)."""
    return from_generation_config({name: _field(reader, key)
                                   for key, name in GGUF_SAMPLING_KEYS.items()})


# ModelConfig field -> GGUF metadata key (after "<arch>.") that sets it.
_GGUF_NAMES = {
    "hidden_size": "embedding_length", "intermediate_size": "feed_forward_length",
    "num_layers": "block_count", "num_heads": "attention.head_count",
    "num_kv_heads": "attention.head_count_kv", "head_dim": "attention.key_length",
    "rms_norm_eps": "attention.layer_norm_rms_epsilon", "rope_theta": "rope.freq_base",
    "rope_local_base_freq": "rope.freq_base_swa", "max_position_embeddings": "context_length",
    "sliding_window": "attention.sliding_window", "rope_scaling.factor": "rope.scaling.factor",
    "query_pre_attn_scalar": "attention.scale"}


def config_from_gguf(reader: gguf.GGUFReader, source: str,
                     tokenizer: Tokenizer | None = None) -> ModelConfig:
    """ModelConfig from GGUF metadata (``{arch}.*`` keys) plus the family facts GGUF omits.

    Raises CheckpointError for an unsupported architecture or unsupported feature (partial
    rotary, YaRN / Llama-3 RoPE scaling, per-layer head counts), and for metadata of the
    wrong type or out of range (naming the key).
    """
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHS:
        raise CheckpointError(f"{source}: GGUF architecture {arch!r} is not supported "
                              f"(supported: {', '.join(SUPPORTED_GGUF_ARCHS)})")
    names = {t.name: t for t in reader.tensors}

    def req(key: str) -> int:
        return _typed(reader, f"{arch}.{key}", source, "int")

    def opt(key: str, default: Any, kind: str = "int") -> Any:
        return _typed(reader, f"{arch}.{key}", source, kind, default)

    hidden, heads = req("embedding_length"), req("attention.head_count")
    for key, v in (("embedding_length", hidden), ("attention.head_count", heads)):
        try:
            check_positive_int(f"{arch}.{key}", v)
        except ConfigError as e:
            raise CheckpointError(f"{source}: {e}") from None
    kv_heads = opt("attention.head_count_kv", heads)
    head_dim = opt("attention.key_length", None)
    if head_dim is None:
        if hidden % heads:
            raise CheckpointError(
                f"{source}: {arch}.attention.head_count {heads} does not divide "
                f"{arch}.embedding_length {hidden} (and no {arch}.attention.key_length gives "
                "the head size)")
        head_dim = hidden // heads
    rot = opt("rope.dimension_count", None)
    if rot is not None and int(rot) != head_dim:
        raise CheckpointError(f"{source}: partial rotary ({rot} of {head_dim} dims) unsupported")
    if "token_embd.weight" not in names:
        raise CheckpointError(f"{source}: missing tensors: token_embd.weight")
    vocab = int(names["token_embd.weight"].shape[1])  # ggml order: [hidden, vocab]
    if "rope_freqs.weight" in names:
        raise CheckpointError(f"{source}: per-dimension rope_freqs (Llama-3 RoPE scaling) are not "
                              "supported from GGUF; load the HF checkpoint directory instead")
    rope_scaling = None
    stype = _field(reader, f"{arch}.rope.scaling.type")
    if stype not in (None, "none"):
        if stype != "linear":
            raise CheckpointError(f"{source}: RoPE scaling {stype!r} is not supported from GGUF")
        rope_scaling = {"rope_type": "linear",
                        "factor": opt("rope.scaling.factor", 1.0, "float")}
    eps_default = 1e-6 if arch == "gemma3" else 1e-5
    kw: dict[str, Any] = {
        "vocab_size": vocab, "hidden_size": hidden,
        "intermediate_size": req("feed_forward_length"),
        "num_layers": req("block_count"), "num_heads": heads, "num_kv_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": opt("attention.layer_norm_rms_epsilon", eps_default, "float"),
        "rope_scaling": rope_scaling,
        "max_position_embeddings": opt("context_length", 4096),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "qk_norm": "blk.0.attn_q_norm.weight" in names,
        "name": str(_field(reader, "general.name", Path(source).stem)),
    }
    if arch == "llama":
        kw.update(family="llama", rope_theta=opt("rope.freq_base", 1e4, "float"))
    else:
        kw.update(_gemma3_facts(reader, kw, source))
    kw["sampling_defaults"] = sampling_defaults_of(reader)
    kw["bos_token_id"] = _typed(reader, "tokenizer.ggml.bos_token_id", source, "int", None)
    eos = _typed(reader, "tokenizer.ggml.eos_token_id", source, "int", None)
    if tokenizer is not None:
        kw["eos_token_ids"] = tokenizer.eos_token_ids
    elif eos is not None:
        kw["eos_token_ids"] = (eos,)
    try:
        return ModelConfig(**kw)
    except ConfigError as e:
        key = _GGUF_NAMES.get(e.field or "")
        if key:
            raise CheckpointError(f"{source}: {arch}.{key} {e.problem}") from e
        if e.field == "vocab_size":
            raise CheckpointError(f"{source}: token_embd.weight gives vocab_size "
                                  f"{e.problem}") from e
        raise CheckpointError(f"{source}: {e}") from e


def _gemma3_facts(reader: gguf.GGUFReader, kw: dict[str, Any], source: str) -> dict[str, Any]:
    """Gemma 3 settings not (always) in the GGUF; defaults from HF Gemma3TextConfig/llama.cpp."""
    n, hidden, heads = kw["num_layers"], kw["hidden_size"], kw["num_heads"]
    key = "gemma3.attention.sliding_window_pattern"
    pattern = _field(reader, key, 6)
    if isinstance(pattern, list):  # per-layer flags, True = sliding
        if len(pattern) != n:
            raise CheckpointError(f"{source}: {key} has {len(pattern)} entries for {n} layers "
                                  "(gemma3.block_count)")
        layer_types = tuple("sliding_attention" if p else "full_attention" for p in pattern)
    else:
        try:
            every = check_positive_int(key, pattern)
        except ConfigError as e:
            raise CheckpointError(f"{source}: {e}") from None
        layer_types = tuple("full_attention" if (i + 1) % every == 0
                            else "sliding_attention" for i in range(n))
    scale = _typed(reader, "gemma3.attention.scale", source, "float", None)
    if scale is not None:
        try:
            qpas = 1.0 / check_positive_number("gemma3.attention.scale", scale) ** 2
        except ConfigError as e:
            raise CheckpointError(f"{source}: {e}") from None
    else:  # llama.cpp gemma3: 27B scales by hidden/heads, the other sizes by head_dim
        qpas = float(hidden // heads if n == 62 else kw["head_dim"])
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if _field(reader, f"gemma3.{key}") is not None:
            raise CheckpointError(f"{source}: gemma3.{key} is not supported")
    return {
        "family": "gemma3",
        "rope_theta": _typed(reader, "gemma3.rope.freq_base", source, "float", 1e6),
        "rope_local_base_freq": _typed(reader, "gemma3.rope.freq_base_swa", source, "float",
                                       1e4),
        "layer_types": layer_types,
        "sliding_window": _typed(reader, "gemma3.attention.sliding_window", source, "int", 512),
        "query_pre_attn_scalar": qpas,
        "embed_scale": math.sqrt(hidden),
        "hidden_act": "gelu_pytorch_tanh",
        "qk_norm": True,
        "post_norms": True,
    }


def reverse_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation: ``w`` is ``[n_head * D, ...]`` (rows = outputs).

    llama.cpp (convert_hf_to_gguf.py ``permute``) reshapes rows to ``[n_head, 2, D/2]`` and
    swaps the last two axes; this reshapes to ``[n_head, D/2, 2]`` and swaps back (as
    transformers' ``_reverse_permute_weights``). Works on weights and 1-D biases.
    """
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def read_gguf_params(reader: gguf.GGUFReader, cfg: ModelConfig, source: str,
                     dtype: str = "float32", progress: bool = True) -> dict[str, np.ndarray]:
    """Dequantize every tensor into the canonical layout (see jaxinfer/models/params.py).

    Returns ``{name: array}`` of exactly ``param_shapes(cfg)`` in ``dtype``. Raises
    CheckpointError for unknown, missing or mis-shaped tensors.
    """
    arch = _field(reader, "general.architecture")
    builder = ParamBuilder(cfg, dtype, source)
    bar = tqdm(reader.tensors, desc=f"dequantize {Path(source).name}", unit="tensor",
               disable=not progress)
    for t in bar:
        layer: int | None = None
        if t.name.startswith("blk."):
            layer, rest = split_layer_name(t.name, "blk.", source)
            spec = _LAYER_TENSORS.get(rest)
        else:
            spec = _TOP_TENSORS.get(t.name)
        if spec is None:
            raise CheckpointError(f"{source}: unexpected tensor {t.name!r} "
                                  f"({t.tensor_type.name}, shape {list(t.shape)})")
        name, transpose = spec
        if name == "lm_head" and cfg.tie_word_embeddings:
            continue
        if t.tensor_type.name in _INT_TYPES:
            raise CheckpointError(
                f"{source}: tensor {t.name!r} is stored as {t.tensor_type.name}, not as floats "
                "or a ggml quantization: the file is probably quantized in a format jaxinfer "
                "does not support")
        file_shape = dict(transpose=transpose, layout="ggml dims, as gguf-dump lists them",
                          reverse_dims=True)
        dims = tuple(int(d) for d in reversed(t.shape))  # ggml dims are reversed
        builder.check(name, dims, layer, t.name, **file_shape)
        try:
            w = dequantize(t.data, t.tensor_type)
        except Exception as e:
            raise CheckpointError(f"{source}: cannot dequantize {t.name!r} "
                                  f"({t.tensor_type.name}): {e}") from e
        w = w.reshape(dims)
        if arch == "llama" and name in ("wq", "bq"):
            w = reverse_permute(w, cfg.num_heads)
        elif arch == "llama" and name in ("wk", "bk"):
            w = reverse_permute(w, cfg.num_kv_heads)
        builder.put(name, w, layer, source_name=t.name, **file_shape)
    return builder.finish()


def load_gguf(path: str | Path, dtype: str = "float32", progress: bool = True,
              with_tokenizer: bool = True) -> LoadedModel:
    """Read a GGUF file into a LoadedModel (config, params, tokenizer from its metadata)."""
    source = str(Path(path))
    reader, cfg, tokenizer = read_gguf_header(path, with_tokenizer)
    params = read_gguf_params(reader, cfg, source, dtype, progress)
    return LoadedModel(config=cfg, params=params, tokenizer=tokenizer, source=source)


def read_gguf_header(path: str | Path, with_tokenizer: bool = True
                     ) -> tuple[gguf.GGUFReader, ModelConfig, Tokenizer | None]:
    """(reader, config, tokenizer or None) of a GGUF file, without reading its tensors.

    Raises CheckpointError (unreadable file, unsupported architecture, bad vocabulary)."""
    source = str(Path(path))
    reader = open_gguf(path)
    tokenizer = None
    if with_tokenizer and "tokenizer.ggml.tokens" in reader.fields:
        # transformers' builders for these types (gguf_tokenizer_mapping.py) need merges, or
        # scores to derive them from; it reports other types as unsupported itself.
        known = _field(reader, "tokenizer.ggml.model") in ("gpt2", "llama", "t5", "gemma4")
        if known and not {"tokenizer.ggml.merges", "tokenizer.ggml.scores"} & set(reader.fields):
            raise CheckpointError(f"{source}: GGUF has tokenizer.ggml.tokens but neither "
                                  "tokenizer.ggml.merges nor tokenizer.ggml.scores: cannot "
                                  "build its tokenizer")
        try:
            tokenizer = Tokenizer.from_gguf(reader)
        except TokenizerError as e:
            raise CheckpointError(str(e)) from e
    return reader, config_from_gguf(reader, source, tokenizer), tokenizer
