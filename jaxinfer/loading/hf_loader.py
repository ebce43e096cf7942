"""HF transformers checkpoint directories -> ModelConfig + canonical params.

A directory holds ``config.json`` and ``model.safetensors`` or a sharded
``model.safetensors.index.json`` (+ shards); read with ``safetensors`` (numpy framework, bf16 as
``ml_dtypes.bfloat16``). ``config.json`` is parsed with transformers' own config classes, so
class defaults (``save_pretrained`` writes only non-default values) and both RoPE spellings
(5.x ``rope_parameters``, older ``rope_theta`` / ``rope_scaling`` / ``rope_local_base_freq``)
resolve as transformers resolves them. Gemma 3 norms compute ``x * (1 + w)``; the 1 is added here.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import safe_open
from tqdm.auto import tqdm

from jaxinfer.config import ConfigError, ModelConfig
from jaxinfer.loading.base import CheckpointError, LoadedModel, ParamBuilder
from jaxinfer.loading.fp8_checkpoint import Fp8Weights, dequantize, parse_quantization_config
from jaxinfer.models.params import FP8_PROJECTIONS
from jaxinfer.tokenizer import Tokenizer, TokenizerError, check_vocab

# HF architecture -> transformers config class name
SUPPORTED_HF_ARCHS = {
    "LlamaForCausalLM": "LlamaConfig",
    "MistralForCausalLM": "MistralConfig",
    "Qwen2ForCausalLM": "Qwen2Config",
    "Qwen3ForCausalLM": "Qwen3Config",
    "Gemma3ForCausalLM": "Gemma3TextConfig",
}
_ROPE_TYPES = ("default", "linear", "llama3")  # what ModelConfig.rope_scaling may carry

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
_GEMMA_NORMS = {"attn_norm", "ffn_norm", "post_attn_norm", "post_ffn_norm", "q_norm", "k_norm",
                "final_norm"}


def read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"cannot read {path}: {e}") from e


def _rope(rp: dict[str, Any] | None, source: str, where: str) -> tuple[float, dict | None]:
    """(theta, rope_scaling or None) from one ``rope_parameters``-style dict."""
    if not isinstance(rp, dict) or "rope_theta" not in rp:
        raise CheckpointError(f"{source}: no rope_theta in {where}")
    rtype = rp.get("rope_type", rp.get("type", "default"))
    if rtype not in _ROPE_TYPES:
        raise CheckpointError(f"{source}: RoPE type {rtype!r} in {where} is not supported "
                              f"(supported: {', '.join(_ROPE_TYPES)})")
    if rtype == "default":
        return float(rp["rope_theta"]), None
    scaling = {k: v for k, v in rp.items() if k not in ("rope_theta", "type", "rope_type")}
    return float(rp["rope_theta"]), {"rope_type": rtype, **scaling}


def _rope_params(c: Any) -> dict[str, Any]:
    """transformers 5.x ``rope_parameters``; rebuilt from the old attributes otherwise."""
    rp = getattr(c, "rope_parameters", None)
    if isinstance(rp, dict) and rp:
        return rp
    old = dict(getattr(c, "rope_scaling", None) or {})
    base = {**old, "rope_theta": getattr(c, "rope_theta", 10000.0)}
    if hasattr(c, "rope_local_base_freq"):  # old Gemma 3 configs: scaling applies to global
        return {"full_attention": base,
                "sliding_attention": {"rope_type": "default",
                                      "rope_theta": c.rope_local_base_freq}}
    return base


# Fields that give a model's shape; missing ones are an error, not the config class' default.
_SHAPE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads")


def config_from_hf(raw: dict[str, Any], source: str,
                   generation_config: dict[str, Any] | None = None) -> ModelConfig:
    """ModelConfig from a parsed ``config.json`` (and optional ``generation_config.json``).

    Raises CheckpointError naming the architecture when it is not supported, a shape field
    the config lacks, or the feature (o_proj/MLP bias, logit soft-capping, YaRN RoPE ...) the
    engine lacks.
    """
    import transformers

    archs = raw.get("architectures") or []
    arch = archs[0] if archs else None
    if arch not in SUPPORTED_HF_ARCHS:
        raise CheckpointError(f"{source}: architecture {arch!r} is not supported "
                              f"(supported: {', '.join(SUPPORTED_HF_ARCHS)})")
    missing = [k for k in _SHAPE_FIELDS if k not in raw]
    if missing:  # transformers would fill in its class defaults (e.g. 32 heads) silently
        raise CheckpointError(f"{source}: config.json lacks {', '.join(missing)} (every "
                              f"{arch} config gives the model's shape)")
    cls = getattr(transformers, SUPPORTED_HF_ARCHS[arch])
    try:
        c = cls.from_dict({k: v for k, v in raw.items() if k != "transformers_version"})
    except Exception as e:
        raise CheckpointError(f"{source}: invalid config.json for {arch}: {e}") from e
    gemma = arch == "Gemma3ForCausalLM"
    heads = int(c.num_attention_heads)
    kv = int(getattr(c, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(c, "head_dim", None) or c.hidden_size // heads)
    if getattr(c, "mlp_bias", False):
        raise CheckpointError(f"{source}: mlp_bias=True is not supported")
    bias = arch == "Qwen2ForCausalLM"  # Qwen2: q/k/v bias always, o_proj none
    if getattr(c, "attention_bias", False) and not bias:
        raise CheckpointError(f"{source}: attention_bias=True ({arch} puts a bias on o_proj "
                              "too) is not supported")
    layer_types = tuple(getattr(c, "layer_types", None) or ())
    window = getattr(c, "sliding_window", None)
    if not layer_types:
        kind = "sliding_attention" if window else "full_attention"
        layer_types = (kind,) * int(c.num_hidden_layers)
    if "sliding_attention" not in layer_types:
        window = None
    rp = _rope_params(c)
    kw: dict[str, Any] = {}
    if gemma:
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if getattr(c, key, None) is not None:
                raise CheckpointError(f"{source}: {key} is not supported")
        if getattr(c, "use_bidirectional_attention", False):
            raise CheckpointError(f"{source}: use_bidirectional_attention is not supported")
        theta, scaling = _rope(rp.get("full_attention"), source, "rope_parameters.full_attention")
        local, local_scaling = _rope(rp.get("sliding_attention"), source,
                                     "rope_parameters.sliding_attention")
        if local_scaling is not None:
            raise CheckpointError(f"{source}: RoPE scaling on sliding layers is not supported")
        kw.update(family="gemma3", rope_local_base_freq=local,
                  query_pre_attn_scalar=float(c.query_pre_attn_scalar),
                  embed_scale=math.sqrt(c.hidden_size), hidden_act=c.hidden_activation,
                  qk_norm=True, post_norms=True)
    else:
        theta, scaling = _rope(rp, source, "rope_parameters")
        kw.update(family="llama", hidden_act=c.hidden_act, qk_norm=arch == "Qwen3ForCausalLM")
    eos: list[int] = []
    for d in (raw, generation_config or {}):
        ids = d.get("eos_token_id")
        eos += [int(x) for x in (ids if isinstance(ids, list) else [ids]) if x is not None]
    bos = raw.get("bos_token_id", getattr(c, "bos_token_id", None))
    try:
        return ModelConfig(
            vocab_size=int(c.vocab_size), hidden_size=int(c.hidden_size),
            intermediate_size=int(c.intermediate_size), num_layers=int(c.num_hidden_layers),
            num_heads=heads, num_kv_heads=kv, head_dim=head_dim,
            rms_norm_eps=float(c.rms_norm_eps), rope_theta=theta, rope_scaling=scaling,
            max_position_embeddings=int(c.max_position_embeddings),
            tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
            attention_bias=bias, layer_types=layer_types, sliding_window=window,
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=tuple(dict.fromkeys(eos)),
            name=str(raw.get("_name_or_path") or Path(source).name), **kw)
    except ConfigError as e:
        raise CheckpointError(f"{source}: {e}") from e


def _weight_map(d: Path) -> dict[str, Path]:
    """{tensor name: safetensors file} from the index, or the single model.safetensors."""
    index, single = d / "model.safetensors.index.json", d / "model.safetensors"
    if index.is_file():
        wm = read_json(index).get("weight_map")
        if not isinstance(wm, dict):
            raise CheckpointError(f"{index} has no weight_map")
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
                    idx, rest = k[len("model.layers."):].split(".", 1)
                    layer, spec = int(idx), _LAYER.get(rest)
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
                builder.put(name, w.T if transpose else w, layer, source_name=k)
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
