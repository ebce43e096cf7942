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
folder holding another ``generation_config.json``, is not supported. GGUF files and the
``dummy:`` models carry none.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jaxinfer.sampling_params import ParameterError, SamplingParams

# generation_config.json key -> SamplingParams field (vLLM's available_params).
GENERATION_KEYS = {"repetition_penalty": "repetition_penalty", "temperature": "temperature",
                   "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
                   "max_new_tokens": "max_tokens"}
GENERATION_CONFIG_MODES = ("auto", "vllm")


def from_generation_config(gen: dict[str, Any] | None, where: str | Path
                           ) -> dict[str, Any]:
    """The SamplingParams fields ``gen`` (a parsed ``generation_config.json``, or None) sets
    by default, as ``{field: value}``.

    Raises:
      ValueError: a value SamplingParams refuses, naming ``where`` (the file) and the key,
        e.g. ``.../generation_config.json: top_p 2.0 is not a default SamplingParams
        accepts: top_p must be in (0, 1]``.
    """
    out: dict[str, Any] = {}
    for key, name in GENERATION_KEYS.items():
        value = (gen or {}).get(key)
        if value is None:
            continue
        try:
            SamplingParams(**{name: value})
        except (ParameterError, TypeError) as e:
            as_ = "" if key == name else f" (the default {name})"
            raise ValueError(f"{where}: {key}{as_} {value!r} is not a default SamplingParams "
                             f"accepts: {e}") from e
        out[name] = value
    return out


def default_sampling_params(defaults: dict[str, Any]) -> SamplingParams:
    """``SamplingParams(**defaults)``: vLLM's ``LLM.get_default_sampling_params()`` for a
    model whose generation config sets ``defaults`` (SamplingParams() for none)."""
    return SamplingParams(**defaults)
