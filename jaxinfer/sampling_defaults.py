"""A model's default sampling parameters, from its ``generation_config.json`` (vLLM's
``--generation-config auto``, its default since v0.8).

vLLM reads the keys of :data:`GENERATION_KEYS` from a checkpoint's generation config
(``ModelConfig.get_diff_sampling_param``; ``max_new_tokens`` becomes ``max_tokens``) and uses
them where a request sets nothing: ``LLM.get_default_sampling_params()`` is what
``LLM.generate`` / ``LLM.chat`` run without sampling params, and the OpenAI server fills the
fields a request leaves out from them. Llama 3.x Instruct's file, for instance, holds
``temperature 0.6, top_p 0.9``; Qwen3's ``temperature 0.6, top_k 20, top_p 0.95``. A key the
file sets to null counts as unset; ``do_sample`` is ignored (as vLLM does: ``temperature 0``
is how a request asks for greedy decoding). ``generation_config="vllm"`` ignores the file:
SamplingParams' own defaults (temperature 1.0, ...), vLLM's other mode. vLLM's third form, a
folder holding another ``generation_config.json``, is not supported. A GGUF file may carry
the same defaults as ``general.sampling.*`` metadata (:data:`GGUF_SAMPLING_KEYS`, which
llama.cpp's converter writes from the generation config and llama.cpp applies); the
``dummy:`` models carry none. A value SamplingParams refuses is an error where the defaults
apply (the engine with ``generation_config="auto"``, ``jaxinfer compile``), naming the file
and key; ``"vllm"`` and the CLI's ``generate`` / ``chat`` (which pass every sampling value
themselves) ignore it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jaxinfer.sampling_params import ParameterError, SamplingParams

# generation_config.json key -> SamplingParams field (vLLM's available_params).
GENERATION_KEYS = {"repetition_penalty": "repetition_penalty", "temperature": "temperature",
                   "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
                   "max_new_tokens": "max_tokens"}
# GGUF metadata key (llama.cpp's convert_hf_to_gguf writes them from generation_config.json;
# gguf.Keys.General.SAMPLING_*) -> SamplingParams field. llama.cpp's others (sequence,
# penalty_last_n, xtc_*, mirostat*) have no SamplingParams field and are not read.
GGUF_SAMPLING_KEYS = {"general.sampling.temp": "temperature",
                      "general.sampling.top_k": "top_k", "general.sampling.top_p": "top_p",
                      "general.sampling.min_p": "min_p",
                      "general.sampling.penalty_repeat": "repetition_penalty"}
GENERATION_CONFIG_MODES = ("auto", "vllm")
_INT32_MAX = 2**31 - 1


def from_generation_config(gen: dict[str, Any] | None) -> dict[str, Any]:
    """The SamplingParams fields ``gen`` (a parsed ``generation_config.json``, or None) sets
    by default, as ``{field: value}``, unchecked (:func:`check_defaults` checks them where
    they apply: ``generation_config="vllm"`` loads a checkpoint whose values are bad, as
    vLLM's ignores the file). An integral float of ``top_k`` / ``max_new_tokens`` (``50.0``)
    becomes an int; either past int32 is capped there, which means the same (a top_k past
    the vocabulary keeps every token; max_tokens is capped at the room after the prompt)
    and fits the gRPC API's int32 fields."""
    out: dict[str, Any] = {}
    for key, name in GENERATION_KEYS.items():
        value = (gen or {}).get(key)
        if value is None:
            continue
        if key in ("top_k", "max_new_tokens") and not isinstance(value, bool):
            if isinstance(value, float) and value.is_integer():
                value = int(value)
            if isinstance(value, int):
                value = min(value, _INT32_MAX)
        out[name] = value
    return out


def check_defaults(defaults: dict[str, Any], where: str,
                   keys: dict[str, str] | None = None) -> None:
    """Raise ValueError for a default SamplingParams refuses, naming ``where`` (the file)
    and the file's key, e.g. ``.../generation_config.json: top_p 2.0 is not a default
    SamplingParams accepts: top_p must be in (0, 1]``."""
    keys = keys or {name: key for key, name in GENERATION_KEYS.items()}
    for name, value in defaults.items():
        try:
            SamplingParams(**{name: value})
        except (ParameterError, TypeError) as e:
            key = keys.get(name, name)
            as_ = "" if key == name else f" (the default {name})"
            raise ValueError(f"{where}: {key}{as_} {value!r} is not a default SamplingParams "
                             f"accepts: {e}") from e


def default_sampling_params(defaults: dict[str, Any]) -> SamplingParams:
    """``SamplingParams(**defaults)``: vLLM's ``LLM.get_default_sampling_params()`` for a
    model whose generation config sets ``defaults`` (SamplingParams() for none)."""
    return SamplingParams(**defaults)


def check_sampling_defaults(defaults: dict[str, Any], source: str) -> None:
    """:func:`check_defaults` for the model read from ``source``, as CheckpointError naming
    its ``generation_config.json``, or the GGUF file (also for a converted copy of one: its
    manifest names the file) and its ``general.sampling.*`` key."""
    from jaxinfer.loading.base import CheckpointError  # (the loaders import this module)
    from jaxinfer.loading.converted_check import read_manifest

    src = str(source)
    if not src.endswith(".gguf") and Path(src).is_dir():  # a converted copy of a GGUF file
        made_from = str((read_manifest(src) or {}).get("from") or "")  # names the file
        src = made_from if made_from.endswith(".gguf") else src
    try:
        if src.endswith(".gguf"):
            check_defaults(defaults, src,
                           {name: key for key, name in GGUF_SAMPLING_KEYS.items()})
        else:
            check_defaults(defaults, f"{Path(source) / 'generation_config.json'}")
    except ValueError as e:
        raise CheckpointError(str(e)) from e
