"""HF transformers checkpoint directories -> ModelConfig + canonical params.

A directory holds ``config.json`` and ``model.safetensors`` or a sharded
``model.safetensors.index.json`` (+ shards); read with ``safetensors`` (numpy framework, bf16 as
``ml_dtypes.bfloat16``). ``config.json`` is read by :mod:`.hf_config`. Gemma 3 norms compute
``x * (1 + w)``; the 1 is added here.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import safe_open
from tqdm.auto import tqdm

from jaxinfer.config import ModelConfig
from jaxinfer.loading.base import (
    CheckpointError,
    LoadedModel,
    ParamBuilder,
    split_layer_name,
)
from jaxinfer.loading.fp8_checkpoint import Fp8Weights, dequantize, parse_quantization_config
from jaxinfer.loading.hf_config import (  # noqa: F401 (re-exported)
    SUPPORTED_HF_ARCHS,
    config_from_hf,
    read_json,
)
from jaxinfer.models.params import FP8_PROJECTIONS
from jaxinfer.tokenizer import Tokenizer, TokenizerError, check_vocab

_TOP = {"model.embed_tokens.weight": ("embed", False), "model.norm.weight": ("final_norm", False),
        "lm_head.weight": ("lm_head", True)}
_LAYER = {
    "input_layernorm.weight": ("attn_norm", False),
    "self_attn.q_proj.weight": ("wq", True), "self_attn.k_proj.weight": ("wk", True),
    "self_attn.v_proj.weight": ("wv", True), "self_attn.o_proj.weight": ("wo", True),
    "self_attn.q_proj.bias": ("bq", False), "self_attn.k_proj.bias": ("bk", False),
    "self_attn.v_proj.bias": ("bv", False),
    "self_attn.q_norm.weight": ("q_norm", False), "self_attn.k_norm.weight": ("k_norm", False),
    "post_attention_layernorm.weight": ("ffn_norm", False),  # gemma3: post_attn_norm
    "pre_feedforward_layernorm.weight": ("ffn_norm", False),  # gemma3 only
    "post_feedforward_layernorm.weight": ("post_ffn_norm", False),
    "mlp.gate_proj.weight": ("w_gate", True), "mlp.up_proj.weight": ("w_up", True),
    "mlp.down_proj.weight": ("w_down", True),
}
# safetensors dtypes that cannot hold float weights (an unrecognised quantized format).
_INT_DTYPES = ("BOOL", "U8", "I8", "U16", "I16", "U32", "I32", "U64", "I64")
_GEMMA_NORMS = {"attn_norm", "ffn_norm", "post_attn_norm", "post_ffn_norm", "q_norm", "k_norm",
                "final_norm"}


def _weight_map(d: Path) -> dict[str, Path]:
    """{tensor name: safetensors file} from the index, or the single model.safetensors."""
    index, single = d / "model.safetensors.index.json", d / "model.safetensors"
    if index.is_file():
        wm = read_json(index).get("weight_map")
        if not isinstance(wm, dict):
            raise CheckpointError(f"{index} has no weight_map")
        for k, f in wm.items():
            if not isinstance(f, str) or not f:
                raise CheckpointError(f"{index}: weight_map gives {f!r} as the file of tensor "
                                      f"{k!r} (expected a shard file name)")
        files = {f: d / f for f in set(wm.values())}
        for f, p in files.items():
            if not p.is_file():
                raise CheckpointError(f"{index} names shard {f}, which is missing from {d}")
        return {k: files[f] for k, f in wm.items()}
    if single.is_file():
        with _open_st(single) as f:
            return dict.fromkeys(f.keys(), single)
    raise CheckpointError(f"{d} has neither model.safetensors nor model.safetensors.index.json")


def _open_st(path: Path) -> Any:
    try:
        return safe_open(str(path), framework="np")
    except Exception as e:  # SafetensorError: header too short / invalid JSON / bad offsets
        raise CheckpointError(f"cannot read safetensors file {path} (truncated or corrupt?): "
                              f"{e}") from e


def read_hf_params(d: Path, cfg: ModelConfig, dtype: str = "float32",
                   progress: bool = True) -> dict[str, np.ndarray]:
    """Read every tensor of the directory into the canonical layout (``param_shapes(cfg)``).

    FP8 weights with their scales (see jaxinfer/loading/fp8_checkpoint.py) are kept in FP8
    for the layers' projections and dequantized elsewhere (embedding, LM head).

    Raises CheckpointError for unreadable files, unexpected, missing or mis-shaped tensors,
    and FP8 formats, scales or tensors that are not supported.
    """
    source = str(d)
    wm = _weight_map(d)
    fp8 = Fp8Weights(parse_quantization_config(read_json(d / "config.json"), source), wm,
                     source)
    by_file: dict[Path, list[str]] = defaultdict(list)
    for k, f in wm.items():
        by_file[f].append(k)
    gemma = cfg.family == "gemma3"
    builder = ParamBuilder(cfg, dtype, source)
    bar = tqdm(total=len(wm), desc=f"load {d.name}", unit="tensor", disable=not progress)
    for path, names in sorted(by_file.items()):
        with _open_st(path) as f:
            present = set(f.keys())
            for k in sorted(names):
                bar.update(1)
                if k.endswith("rotary_emb.inv_freq") or fp8.is_scale(k):
                    continue  # scales are read with their FP8 weight
                layer: int | None = None
                if k.startswith("model.layers."):
                    layer, rest = split_layer_name(k, "model.layers.", path)
                    spec = _LAYER.get(rest)
                    if gemma and rest == "post_attention_layernorm.weight":
                        spec = ("post_attn_norm", False)
                else:
                    spec = _TOP.get(k)
                if spec is None:
                    raise CheckpointError(f"{path}: unexpected tensor {k!r}")
                name, transpose = spec
                if name == "lm_head" and cfg.tie_word_embeddings:
                    fp8.skip(k)
                    continue
                if k not in present:
                    raise CheckpointError(f"{path}: lacks tensor {k!r} named in the index")
                st_dtype = f.get_slice(k).get_dtype()
                if st_dtype in _INT_DTYPES:
                    raise CheckpointError(
                        f"{path}: tensor {k!r} is stored as {st_dtype}, not as floats: the "
                        "checkpoint is probably quantized in a format jaxinfer does not support "
                        "(config.json has no quantization_config that explains integer "
                        "weights; supported: FP8)")
                if st_dtype.startswith("F8"):
                    q, scale = fp8.read(path, k, st_dtype)
                    if layer is not None and transpose and f"layers.{name}" in FP8_PROJECTIONS:
                        builder.put_fp8(name, q, scale, layer, source_name=k)
                        continue
                    w = dequantize(q, scale).T  # not kept in FP8: e.g. an FP8 lm_head
                else:
                    try:
                        w = f.get_tensor(k)
                    except Exception as e:
                        raise CheckpointError(f"{path}: cannot read tensor {k!r}: {e}") from e
                if gemma and name in _GEMMA_NORMS:
                    w = w.astype(np.float32) + 1.0  # Gemma RMSNorm computes x * (1 + w)
                builder.put(name, w, layer, source_name=k, transpose=transpose,
                            layout="[out, in] as stored" if transpose else "")
    bar.close()
    fp8.check_all_used()
    return builder.finish()


def load_hf(path: str | Path, dtype: str = "float32", progress: bool = True,
            with_tokenizer: bool = True) -> LoadedModel:
    """Load an HF checkpoint directory into a LoadedModel (tokenizer if the directory has one)."""
    d = Path(path)
    cfg, tokenizer = read_hf_header(d, with_tokenizer)
    params = read_hf_params(d, cfg, dtype, progress)
    return LoadedModel(config=cfg, params=params, tokenizer=tokenizer, source=str(d))


def read_hf_header(d: Path, with_tokenizer: bool = True) -> tuple[ModelConfig, Tokenizer | None]:
    """(config, tokenizer or None) of an HF checkpoint directory, without reading weights.

    Raises CheckpointError (no config.json, unsupported architecture, bad tokenizer)."""
    if not (d / "config.json").is_file():
        raise CheckpointError(f"{d} has no config.json (not an HF checkpoint directory)")
    raw = read_json(d / "config.json")
    gen = read_json(d / "generation_config.json") if (d / "generation_config.json").is_file() \
        else None
    cfg = config_from_hf(raw, str(d), gen)
    tokenizer = None
    if with_tokenizer and ((d / "tokenizer.json").is_file()
                           or (d / "tokenizer_config.json").is_file()):
        try:
            tokenizer = Tokenizer.from_pretrained(d, extra_eos_ids=cfg.eos_token_ids)
            check_vocab(tokenizer, cfg.vocab_size, d)
        except TokenizerError as e:
            raise CheckpointError(str(e)) from e
        eos = tuple(dict.fromkeys(cfg.eos_token_ids + tokenizer.eos_token_ids))
        cfg = cfg.replace(eos_token_ids=eos)
    return cfg, tokenizer
