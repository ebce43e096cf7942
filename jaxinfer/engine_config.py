"""The configuration an engine runs a model with: its :class:`EngineConfig` (defaults and
bucket choices that depend on the model and the attention backend) and its dtype. Shared by
``LLMEngine`` (jaxinfer/engine.py), ``jaxinfer compile`` and the benchmarks, which need them
without an engine.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from typing import Any

import jax
import jax.numpy as jnp

from jaxinfer.config import ConfigError, EngineConfig, ModelConfig
from jaxinfer.layers.attention import resolve_backend_name


def _resolve_dtype(name: str) -> Any:
    if name == "auto":
        return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    if name not in ("float32", "bfloat16"):
        raise ConfigError(f"dtype must be 'auto', 'float32' or 'bfloat16', got {name!r}")
    return {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[name]


def check_engine_args(model: Any, engine_args: dict[str, Any]) -> None:
    """Refuse, before any loading, a ``model`` that is not a name, a path or a LoadedModel
    (``LLM(123)`` used to fail with an AttributeError) and an ``engine_args`` key that is no
    :class:`EngineConfig` field (``LLM(max_num_seq=4)`` used to load the model first, then
    raise TypeError). Raises ConfigError naming the argument (and the closest field)."""
    if not isinstance(model, (str, os.PathLike)) and not all(
            hasattr(model, a) for a in ("config", "params", "tokenizer")):
        raise ConfigError(f"model must be a model name, a checkpoint path or a LoadedModel, "
                          f"got {type(model).__name__}", field="model")
    fields = [f.name for f in dataclasses.fields(EngineConfig)]
    for key in engine_args:
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"unknown engine option {key!r}{hint}", field=key)


# Batch limits where JAX's default backend is a GPU, for options not given: vLLM's
# max_num_seqs (256; vllm/engine/arg_utils.py, raised to 1024 on 70 GB-class cards) and its
# server's prefill budget on those cards (8192 tokens a step); prefill rows cost nothing
# extra with the Pallas kernels (one row count is compiled). EngineConfig's own defaults
# (8 sequences, 512 tokens, 8 prefill rows) stay the CPU's: a laptop's memory and compile
# time. More buckets mean more programs: a server builds the decode ones in its warm-up
# (warmup.py) and, on a GPU, the prefill ones too (`serve --no-warmup-prefill` leaves those
# to first use, unless `jaxinfer compile` built them).
GPU_DEFAULTS = {"max_num_seqs": 256, "max_num_batched_tokens": 8192, "max_prefill_seqs": 64}


def _ints_given(buckets: Any) -> bool:
    """A non-empty sequence of ints (bad bucket lists are EngineConfig's to refuse)."""
    return (isinstance(buckets, (list, tuple)) and len(buckets) > 0
            and all(isinstance(b, int) and not isinstance(b, bool) for b in buckets))


def engine_config_for(model_config: ModelConfig, engine_args: dict[str, Any]) -> EngineConfig:
    """The EngineConfig the engine runs ``model_config`` with: max_model_len defaults to
    min(2048, the model's context), and on a GPU backend the batch limits not given to
    :data:`GPU_DEFAULTS`, each capped by the largest bucket given for it (``decode_buckets``
    1..32 alone means 32 sequences) and the prefill rows by max_num_seqs. Raises
    ConfigError for bad or too-large values."""
    args = dict(engine_args)
    args.setdefault("max_model_len", min(2048, model_config.max_position_embeddings))
    gpu = jax.default_backend() != "cpu"
    for name, buckets in (("max_num_seqs", "decode_buckets"),
                          ("max_num_batched_tokens", "prefill_buckets"),
                          ("max_prefill_seqs", "prefill_seq_buckets")):
        if args.get(name) is None:  # not given, or None: the default
            args.pop(name, None)
            if gpu:
                given = args.get(buckets)
                caps = [GPU_DEFAULTS[name]] + ([max(given)] if _ints_given(given) else [])
                if name == "max_prefill_seqs" and isinstance(args["max_num_seqs"], int):
                    caps.append(args["max_num_seqs"])
                args[name] = max(1, min(caps))
    ec = EngineConfig(**args)
    if resolve_backend_name(ec.attention_backend) in ("pallas", "pallas_mgpu"):  # paged kernels
        # The Pallas kernels read only each sequence's own pages and rows, so block-table
        # width and prefill row count cost nothing: one compiled width and row count instead
        # of a grid of them (134 -> 17 programs for the default 8B set; vLLM's block table
        # is likewise [max_num_seqs, max_blocks_per_seq]). The jnp reference gathers every
        # page of the table, so it keeps the narrow buckets.
        narrow = {}
        if not engine_args.get("page_buckets"):
            narrow["page_buckets"] = (ec.max_pages_per_seq,)
        if not engine_args.get("prefill_seq_buckets"):
            narrow["prefill_seq_buckets"] = (ec.max_prefill_seqs,)
        ec = dataclasses.replace(ec, **narrow)
    if ec.max_model_len > model_config.max_position_embeddings:
        raise ConfigError(f"max_model_len {ec.max_model_len} exceeds the model's context "
                          f"length {model_config.max_position_embeddings}")
    return ec
