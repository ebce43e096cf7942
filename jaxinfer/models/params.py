"""The engine's canonical weight layout: one flat dict of arrays, shared by every loader.

Every loader (GGUF, HF safetensors, orbax, dummy) produces ``{name: np.ndarray}`` with exactly
the names and shapes of :func:`param_shapes`; the models consume that dict. Projection
matrices are stored ``[in, out]`` so a layer computes ``x @ w``. Per-layer tensors are stacked
along a leading layer axis ``L`` so the layers run under one ``jax.lax.scan``.

Names (H hidden, F FFN, V vocab, D head dim, Hq / Hkv query / KV heads, L layers):

=====================  ===============  ==================================================
name                   shape            HF transformers source (per layer ``i``)
=====================  ===============  ==================================================
embed                  [V, H]           model.embed_tokens.weight
final_norm             [H]              model.norm.weight
lm_head                [H, V]           lm_head.weight.T (absent when tie_word_embeddings)
layers.attn_norm       [L, H]           input_layernorm
layers.wq              [L, H, Hq*D]     self_attn.q_proj.weight.T
layers.wk              [L, H, Hkv*D]    self_attn.k_proj.weight.T
layers.wv              [L, H, Hkv*D]    self_attn.v_proj.weight.T
layers.wo              [L, Hq*D, H]     self_attn.o_proj.weight.T
layers.bq/bk/bv        [L, Hq*D] ...    q/k/v_proj.bias (attention_bias, e.g. Qwen2)
layers.q_norm/k_norm   [L, D]           self_attn.q_norm / k_norm (qk_norm: Qwen3, Gemma 3)
layers.ffn_norm        [L, H]           post_attention_layernorm (llama family);
                                        pre_feedforward_layernorm (Gemma 3)
layers.post_attn_norm  [L, H]           post_attention_layernorm (Gemma 3 only)
layers.post_ffn_norm   [L, H]           post_feedforward_layernorm (Gemma 3 only)
layers.w_gate          [L, H, F]        mlp.gate_proj.weight.T
layers.w_up            [L, H, F]        mlp.up_proj.weight.T
layers.w_down          [L, F, H]        mlp.down_proj.weight.T
=====================  ===============  ==================================================

Norm weights are multiplicative as stored: Gemma's ``(1 + w)`` is folded in at load time
(GGUF files already store ``1 + w``; the HF loader adds the 1).

FP8 (``quantization="fp8"``, or a checkpoint that carries FP8 weights): any of the
:data:`FP8_PROJECTIONS` may instead be float8_e4m3fn of the same shape, with a float32
``<name>_scale`` of ``[L, N]`` (one scale per output channel) or ``[L, K / g, N]`` (one per
group of ``g`` input rows); see jaxinfer/quantization.py.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from jaxinfer.config import ModelConfig

# Projections that may be stored as FP8 (e4m3) with scales (embedding and LM head stay in
# the model dtype, as vLLM's Fp8LinearMethod keeps lm_head).
FP8_PROJECTIONS = ("layers.wq", "layers.wk", "layers.wv", "layers.wo", "layers.w_gate",
                   "layers.w_up", "layers.w_down")
_FP8 = np.dtype(ml_dtypes.float8_e4m3fn)


class WeightError(ValueError):
    """A checkpoint's tensors do not match the model configuration."""


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Names and shapes of every tensor the model needs for ``cfg``."""
    H, F, V, D, L = (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.head_dim,
                     cfg.num_layers)
    q, kv = cfg.q_size, cfg.kv_size
    s: dict[str, tuple[int, ...]] = {
        "embed": (V, H),
        "final_norm": (H,),
        "layers.attn_norm": (L, H),
        "layers.wq": (L, H, q),
        "layers.wk": (L, H, kv),
        "layers.wv": (L, H, kv),
        "layers.wo": (L, q, H),
        "layers.ffn_norm": (L, H),
        "layers.w_gate": (L, H, F),
        "layers.w_up": (L, H, F),
        "layers.w_down": (L, F, H),
    }
    if not cfg.tie_word_embeddings:
        s["lm_head"] = (H, V)
    if cfg.attention_bias:
        s.update({"layers.bq": (L, q), "layers.bk": (L, kv), "layers.bv": (L, kv)})
    if cfg.qk_norm:
        s.update({"layers.q_norm": (L, D), "layers.k_norm": (L, D)})
    if cfg.post_norms:
        s.update({"layers.post_attn_norm": (L, H), "layers.post_ffn_norm": (L, H)})
    return s


def fp8_names(params: dict[str, np.ndarray]) -> list[str]:
    """The projections of ``params`` stored as float8_e4m3fn (each has a ``*_scale``)."""
    return [k for k in FP8_PROJECTIONS if k in params and np.dtype(params[k].dtype) == _FP8]


def fp8_scale_layout(weight_shape: tuple[int, ...], scale_shape: tuple[int, ...]) -> int | None:
    """Rows per scale group of an FP8 weight ``[..., K, N]`` whose scale is ``scale_shape``:
    None for one scale per output channel (``[..., N]``), ``g = K / G`` for ``[..., G, N]``.

    Raises WeightError naming both shapes for a scale that fits neither layout.
    """
    lead, (K, N) = tuple(weight_shape[:-2]), tuple(weight_shape[-2:])
    scale_shape = tuple(scale_shape)
    if scale_shape == lead + (N,):
        return None
    if (len(scale_shape) == len(lead) + 2 and scale_shape[:-2] == lead and scale_shape[-1] == N
            and scale_shape[-2] > 0 and K % scale_shape[-2] == 0):
        return K // scale_shape[-2]
    raise WeightError(f"scale of shape {scale_shape} does not fit an FP8 weight of shape "
                      f"{tuple(weight_shape)}: expected {lead + (N,)} (per channel) or "
                      f"{lead + ('G', N)} with G dividing {K} (per group)")


def check_params(cfg: ModelConfig, params: dict[str, np.ndarray], source: str = "") -> None:
    """Raise :class:`WeightError` naming the first missing, extra or mis-shaped tensor.

    FP8 projections (see the module docstring) need a ``*_scale`` of a valid shape; a scale
    without an FP8 weight is an unexpected tensor.
    """
    where = f" in {source}" if source else ""
    want = param_shapes(cfg)
    for name in fp8_names(params):
        scale = params.get(name + "_scale")
        if scale is None:
            raise WeightError(f"FP8 tensor {name!r}{where} has no {name}_scale")
        w_shape, s_shape = tuple(params[name].shape), tuple(scale.shape)
        if w_shape == want.get(name):  # else the weight's own shape error comes first
            try:
                fp8_scale_layout(w_shape, s_shape)
            except WeightError as e:
                raise WeightError(f"tensor {name}_scale{where}: {e}") from None
        want[name + "_scale"] = s_shape
    missing = sorted(set(want) - set(params))
    if missing:
        raise WeightError(f"checkpoint{where} lacks tensors {missing[:5]}"
                          + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
    extra = sorted(set(params) - set(want))
    if extra:
        raise WeightError(f"checkpoint{where} has unexpected tensors {extra[:5]}")
    for name, shape in want.items():
        got = tuple(params[name].shape)
        if got != shape:
            raise WeightError(f"tensor {name!r}{where} has shape {got}, expected {shape}")


def stack_layers(per_layer: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Stack ``[{"wq": ...}, ...]`` (one dict per layer) into ``{"layers.wq": [L, ...]}``."""
    if not per_layer:
        raise WeightError("checkpoint has no layers")
    keys = per_layer[0].keys()
    for i, d in enumerate(per_layer):
        if d.keys() != keys:
            diff = sorted(set(keys) ^ set(d.keys()))
            raise WeightError(f"layer {i} has a different tensor set from layer 0: {diff}")
    return {f"layers.{k}": np.stack([d[k] for d in per_layer]) for k in keys}
