"""Random ("dummy") weights at named shapes, for benchmarks and tests (vLLM ``--load-format
dummy``): weight values do not change the speed.

Projections are normal with std ``1/sqrt(fan_in)`` (fan_in = the ``in`` axis of ``[in, out]``),
norm weights ``1 + 0.02 * normal``, biases ``0.02 * normal``. Generating 8B normals one by one
takes minutes, so one pool of unit normals (a prime length, so rows do not line up) is drawn
once and each tensor is filled by copying the pool, scaled and cast, from a random offset: the
cost is a memory copy. Arrays are made directly in the requested dtype (bf16 via ml_dtypes),
never as float32 first.

FP8 dummy weights (``fp8=...``, what ``load_model("dummy:...", quantization="fp8")`` uses) are
made directly as float8_e4m3fn values with per-output-channel float32 scales, the layout that
``quantization="fp8"`` produces, without a bf16 copy first: the 70B shape in FP8 is ~70 GB on
the host instead of 141 GB of bf16 plus its quantized copy. The values are the same
distribution as the bf16 dummy's (``w = q * scale``, std ``1/sqrt(fan_in)``), but not the
quantization of the bf16 dummy's bits.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from jaxinfer.config import ModelConfig
from jaxinfer.loading.base import CheckpointError, LoadedModel, np_dtype
from jaxinfer.models.params import param_shapes

# Llama 3.1 (HF config.json of meta-llama/Llama-3.1-8B / -70B)
_LLAMA31: dict[str, Any] = {
    "family": "llama", "vocab_size": 128256, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    "max_position_embeddings": 131072, "head_dim": 128, "bos_token_id": 128000,
    "eos_token_ids": (128001, 128008, 128009)}

DUMMY_CONFIGS: dict[str, ModelConfig] = {
    "llama-3.1-8b": ModelConfig(**_LLAMA31, hidden_size=4096, intermediate_size=14336,
                                num_layers=32, num_heads=32, num_kv_heads=8,
                                name="dummy:llama-3.1-8b"),
    "llama-3.1-70b": ModelConfig(**_LLAMA31, hidden_size=8192, intermediate_size=28672,
                                 num_layers=80, num_heads=64, num_kv_heads=8,
                                 name="dummy:llama-3.1-70b"),
    # Gemma 3 270M (shared/models.md; the config the real GGUF gives, test_loading.py):
    # 4 q heads / 1 KV head of 256, 5 sliding-window layers (512) to each global one.
    "gemma-3-270m": ModelConfig(family="gemma3", vocab_size=262144, hidden_size=640,
                                intermediate_size=2048, num_layers=18, num_heads=4,
                                num_kv_heads=1, head_dim=256, rms_norm_eps=1e-6,
                                rope_theta=1e6, rope_local_base_freq=1e4,
                                max_position_embeddings=32768, tie_word_embeddings=True,
                                qk_norm=True, post_norms=True, hidden_act="gelu_pytorch_tanh",
                                layer_types=(("sliding_attention",) * 5
                                             + ("full_attention",)) * 3,
                                sliding_window=512, query_pre_attn_scalar=256.0,
                                embed_scale=640 ** 0.5, bos_token_id=2, eos_token_ids=(1,),
                                name="dummy:gemma-3-270m"),
    "tiny-llama": ModelConfig(family="llama", vocab_size=256, hidden_size=64,
                              intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                              head_dim=16, max_position_embeddings=512, bos_token_id=1,
                              eos_token_ids=(2,), name="dummy:tiny-llama"),
    "tiny-gemma3": ModelConfig(family="gemma3", vocab_size=256, hidden_size=64,
                               intermediate_size=128, num_layers=6, num_heads=4, num_kv_heads=1,
                               head_dim=32, rms_norm_eps=1e-6, rope_theta=1e6,
                               rope_local_base_freq=1e4, max_position_embeddings=512,
                               tie_word_embeddings=True, qk_norm=True, post_norms=True,
                               hidden_act="gelu_pytorch_tanh",
                               layer_types=("sliding_attention",) * 5 + ("full_attention",),
                               sliding_window=8, query_pre_attn_scalar=32.0, embed_scale=8.0,
                               bos_token_id=2, eos_token_ids=(1,), name="dummy:tiny-gemma3"),
}

_POOL_SIZE = 16_777_259  # a prime just above 2**24: 64 MiB of float32
_FP8_UNIT = 64.0  # a unit normal maps to e4m3 / 64: 7 sigma = 448, the e4m3 maximum


def dummy_params(cfg: ModelConfig, dtype: str = "float32", seed: int = 0,
                 fp8: Iterable[str] = ()) -> dict[str, np.ndarray]:
    """Random params of exactly ``param_shapes(cfg)`` in ``dtype`` ("float32"/"bfloat16").

    The stacked projections named in ``fp8`` (e.g. ``models.params.FP8_PROJECTIONS``) come
    as float8_e4m3fn ``[L, K, N]`` with a float32 ``name + "_scale"`` ``[L, N]`` instead.
    """
    import ml_dtypes

    dt = np_dtype(dtype)
    fp8 = set(fp8)
    rng = np.random.default_rng(seed)
    pool = rng.standard_normal(_POOL_SIZE, dtype=np.float32)
    cast: dict[tuple[float, float, Any], np.ndarray] = {}  # (std, mean, dtype) -> pool*std+mean

    def fill(shape: tuple[int, ...], std: float, mean: float = 0.0, out_dt: Any = dt
             ) -> np.ndarray:
        key = (std, mean, out_dt)
        if key not in cast:
            vals = pool * np.float32(std) + np.float32(mean)
            if out_dt == ml_dtypes.float8_e4m3fn:  # no inf: out-of-range casts would be NaN
                vals = np.clip(vals, -448.0, 448.0)
            cast[key] = vals.astype(out_dt)
        src = cast[key]
        out = np.empty(shape, dtype=out_dt)
        flat = out.reshape(-1)
        pos, off = 0, int(rng.integers(_POOL_SIZE))
        while pos < flat.size:
            n = min(flat.size - pos, _POOL_SIZE - off)
            flat[pos:pos + n] = src[off:off + n]
            pos, off = pos + n, 0
        return out

    params: dict[str, np.ndarray] = {}
    for name, shape in param_shapes(cfg).items():
        short = name.removeprefix("layers.")
        if short.endswith("norm"):
            params[name] = fill(shape, 0.02, 1.0)
        elif short in ("bq", "bk", "bv"):
            params[name] = fill(shape, 0.02)
        elif name == "embed":
            params[name] = fill(shape, 1.0 / np.sqrt(cfg.hidden_size))
        elif name in fp8:  # e4m3 of N(0, 64^2), times std / 64 per output channel
            params[name] = fill(shape, _FP8_UNIT, out_dt=ml_dtypes.float8_e4m3fn)
            scale = np.float32(1.0 / np.sqrt(shape[-2]) / _FP8_UNIT)
            params[name + "_scale"] = np.full(shape[:-2] + shape[-1:], scale, np.float32)
        else:  # [.., in, out] projections and lm_head [H, V]
            params[name] = fill(shape, 1.0 / np.sqrt(shape[-2]))
    return params


def load_dummy(shape: str, dtype: str = "float32", seed: int = 0, fp8: Iterable[str] = ()
               ) -> LoadedModel:
    """``dummy:<shape>`` -> LoadedModel with random params (``fp8``: as in
    :func:`dummy_params`) and no tokenizer.

    Raises CheckpointError for an unknown shape, listing the known ones.
    """
    if shape not in DUMMY_CONFIGS:
        raise CheckpointError(f"unknown dummy shape {shape!r}; known: "
                              f"{', '.join('dummy:' + k for k in DUMMY_CONFIGS)}")
    cfg = DUMMY_CONFIGS[shape]
    return LoadedModel(config=cfg, params=dummy_params(cfg, dtype, seed, fp8),
                       tokenizer=None, source=f"dummy:{shape}")
