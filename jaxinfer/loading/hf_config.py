"""HF ``config.json`` (+ ``generation_config.json``) -> ModelConfig.

``config.json`` is parsed with transformers' own config classes, so class defaults
(``save_pretrained`` writes only non-default values) and both RoPE spellings (5.x
``rope_parameters``, older ``rope_theta`` / ``rope_scaling`` / ``rope_local_base_freq``) resolve
as transformers resolves them. Errors name the file and the config key that is wrong.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from jaxinfer.config import (
    ConfigError,
    ModelConfig,
    check_positive_int,
    check_positive_number,
    check_rope_scaling,
)
from jaxinfer.loading.base import CheckpointError
from jaxinfer.sampling_defaults import from_generation_config

# HF architecture -> transformers config class name
SUPPORTED_HF_ARCHS = {
    "LlamaForCausalLM": "LlamaConfig",
    "MistralForCausalLM": "MistralConfig",
    "Qwen2ForCausalLM": "Qwen2Config",
    "Qwen3ForCausalLM": "Qwen3Config",
    "Gemma3ForCausalLM": "Gemma3TextConfig",
}
_ROPE_TYPES = ("default", "linear", "llama3")  # what ModelConfig.rope_scaling may carry
def read_json(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``; CheckpointError when unreadable or not an object."""
    try:
        d = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"cannot read {path}: {e}") from e
    if not isinstance(d, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(d).__name__} "
                              f"{json.dumps(d)[:60]}")
    return d


def _rope(rp: dict[str, Any] | None, source: str, where: str,
          theta_name: str | None = None) -> tuple[float, dict | None]:
    """(theta, rope_scaling or None) from one ``rope_parameters``-style dict; ``where`` is
    its name in the config (``rope_parameters``, ``rope_scaling`` for old configs), and
    ``theta_name`` the name of its theta there (default ``<where>.rope_theta``)."""
    if not isinstance(rp, dict) or "rope_theta" not in rp:
        raise CheckpointError(f"{source}: no rope_theta in {where}")
    rtype = rp.get("rope_type", rp.get("type", "default"))
    if rtype not in _ROPE_TYPES:
        raise CheckpointError(f"{source}: RoPE type {rtype!r} in {where} is not supported "
                              f"(supported: {', '.join(_ROPE_TYPES)})")
    theta_name = theta_name or f"{where}.rope_theta"
    try:
        theta = check_positive_number(theta_name, rp["rope_theta"])
        if rtype == "default":
            return theta, None
        scaling = {k: v for k, v in rp.items() if k not in ("rope_theta", "type", "rope_type")}
        scaling = {"rope_type": rtype, **scaling}
        check_rope_scaling(scaling, where)
    except ConfigError as e:
        raise CheckpointError(f"{Path(source) / 'config.json'}: {e}") from None
    return theta, scaling


def _rope_params(c: Any) -> dict[str, Any]:
    """transformers 5.x ``rope_parameters``; rebuilt from the old attributes otherwise (with
    transformers 5.x the config class builds ``rope_parameters`` from the old keys too)."""
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
    if not isinstance(archs, list):  # a str would be read a character at a time
        raise CheckpointError(f"{source}: config.json's architectures must be a list of "
                              f"class names, got {type(archs).__name__} {archs!r:.60}")
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
        why = " ".join(line.strip() for line in str(e).splitlines())  # one line
        raise CheckpointError(f"{Path(source) / 'config.json'}: invalid for {arch}: {why}") from e
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
    layer_types, window = _attention_layout(arch, c, raw, source)
    rp = _rope_params(c)
    new_rope = "rope_parameters" in raw  # else old keys: rope_theta, rope_scaling ...
    kw: dict[str, Any] = {}
    if gemma:
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if getattr(c, key, None) is not None:
                raise CheckpointError(f"{source}: {key} is not supported")
        if getattr(c, "use_bidirectional_attention", False):
            raise CheckpointError(f"{source}: use_bidirectional_attention is not supported")
        if new_rope:
            theta, scaling = _rope(rp.get("full_attention"), source,
                                   "rope_parameters.full_attention")
            local, local_scaling = _rope(rp.get("sliding_attention"), source,
                                         "rope_parameters.sliding_attention")
        else:
            theta, scaling = _rope(rp.get("full_attention"), source, "rope_scaling",
                                   "rope_theta")
            local, local_scaling = _rope(rp.get("sliding_attention"), source,
                                         "rope_parameters.sliding_attention",
                                         "rope_local_base_freq")
        if local_scaling is not None:
            raise CheckpointError(f"{source}: RoPE scaling on sliding layers is not supported")
        kw.update(family="gemma3", rope_local_base_freq=local,
                  query_pre_attn_scalar=float(c.query_pre_attn_scalar),
                  embed_scale=math.sqrt(c.hidden_size), hidden_act=c.hidden_activation,
                  qk_norm=True, post_norms=True)
    else:
        theta, scaling = (_rope(rp, source, "rope_parameters") if new_rope
                          else _rope(rp, source, "rope_scaling", "rope_theta"))
        kw.update(family="llama", hidden_act=c.hidden_act, qk_norm=arch == "Qwen3ForCausalLM")
    vocab = getattr(c, "vocab_size", None)  # ids past it: an eos never stops a sequence
    vocab = vocab if isinstance(vocab, int) and not isinstance(vocab, bool) and vocab > 0 \
        else None  # (a bad vocab_size: ModelConfig names it below)
    eos: list[int] = []
    for d, fname in ((raw, "config.json"), (generation_config or {}, "generation_config.json")):
        ids = d.get("eos_token_id")
        eos += _token_ids(ids if isinstance(ids, list) else [ids], source, fname,
                          "eos_token_id", vocab)
    bos = raw.get("bos_token_id", getattr(c, "bos_token_id", None))
    if bos is not None:
        bos = _token_ids([bos], source, "config.json", "bos_token_id", vocab)[0]
    defaults = from_generation_config(generation_config)  # checked where they apply
    try:
        return ModelConfig(
            vocab_size=int(c.vocab_size), hidden_size=int(c.hidden_size),
            intermediate_size=int(c.intermediate_size), num_layers=int(c.num_hidden_layers),
            num_heads=heads, num_kv_heads=kv, head_dim=head_dim,
            rms_norm_eps=float(c.rms_norm_eps), rope_theta=theta, rope_scaling=scaling,
            max_position_embeddings=int(c.max_position_embeddings),
            tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
            attention_bias=bias, layer_types=layer_types, sliding_window=window,
            bos_token_id=bos, eos_token_ids=tuple(dict.fromkeys(eos)),
            sampling_defaults=defaults,
            name=str(raw.get("_name_or_path") or Path(source).name), **kw)
    except ConfigError as e:
        field = _HF_NAMES.get(e.field or "", e.field)
        raise CheckpointError(f"{Path(source) / 'config.json'}: "
                              f"{f'{field} {e.problem}' if e.field else e}") from e


# ModelConfig field -> its config.json key, where they differ.
_HF_NAMES = {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
             "num_kv_heads": "num_key_value_heads", "embed_scale": "hidden_size"}


def _token_ids(ids: list[Any], source: str, fname: str, key: str,
               vocab: int | None = None) -> list[int]:
    """The non-null entries of ``ids`` as ints; CheckpointError naming the file and key
    for anything that is not a non-negative integer (below ``vocab`` where given)."""
    out = []
    for x in ids:
        if x is None:
            continue
        if isinstance(x, bool) or not isinstance(x, int) or x < 0:
            raise CheckpointError(f"{Path(source) / fname}: {key} holds {x!r}, which is not a "
                                  "token id (a non-negative integer)")
        if vocab is not None and x >= vocab:
            raise CheckpointError(f"{Path(source) / fname}: {key} {x} is not in the "
                                  f"vocabulary [0, {vocab})")
        out.append(x)
    return out


def _attention_layout(arch: str, c: Any, raw: dict[str, Any], source: str
                      ) -> tuple[tuple[str, ...], int | None]:
    """(layer_types, sliding window or None) as transformers applies them for ``arch``.

    * Llama: no sliding window (modeling_llama.py has none), except layers that an explicit
      ``layer_types`` marks ``sliding_attention`` (as vLLM reads it).
    * Mistral: ``sliding_window`` on every layer when set (modeling_mistral.py ignores
      ``layer_types``).
    * Qwen2/Qwen3, Gemma 3: the config class' ``layer_types`` (Qwen: sliding only with
      ``use_sliding_window``, from layer ``max_window_layers`` on; the class sets
      ``sliding_window`` to None without ``use_sliding_window``, and a sliding layer without a
      window attends fully, as in transformers).

    Raises CheckpointError naming ``sliding_window`` when a window in use is not a positive
    integer.
    """
    n = int(c.num_hidden_layers)
    window = getattr(c, "sliding_window", None)
    if arch == "LlamaForCausalLM":
        types = tuple(raw.get("layer_types") or ("full_attention",) * n)
    elif arch == "MistralForCausalLM":
        types = ("full_attention" if window is None else "sliding_attention",) * n
    else:
        types = tuple(getattr(c, "layer_types", None) or ("full_attention",) * n)
        if window is None:
            types = ("full_attention",) * len(types)
    if "sliding_attention" not in types:
        return types, None
    try:
        return types, check_positive_int("sliding_window", window)
    except ConfigError as e:
        raise CheckpointError(f"{Path(source) / 'config.json'}: {e}") from None
