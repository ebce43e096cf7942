"""Decoder-only transformer for the llama family and Gemma 3, in Flax NNX.

One module serves every supported family; the differences are config flags read at trace
time (HF transformers' modeling_llama / qwen2 / qwen3 / mistral / gemma3 are the references):

* Llama 3/3.1, SmolLM2: RMSNorm, RoPE (optionally Llama-3 scaled), GQA, SwiGLU.
* Mistral: as Llama, optionally sliding-window attention on every layer.
* Qwen2: bias on the q/k/v projections (``attention_bias``).
* Qwen3: RMSNorm on q and k per head before RoPE (``qk_norm``).
* Gemma 3: embeddings scaled by sqrt(hidden) (``embed_scale``), q/k norms, post-attention and
  post-FFN norms (``post_norms``), GELU-tanh gating, sliding-window layers with their own
  RoPE base (``rope_local_base_freq``) interleaved with global layers, and softmax scale
  ``query_pre_attn_scalar ** -0.5``.

Per-layer weights are stacked on a leading axis and the layers run under ``jax.lax.scan``,
so compile time does not grow with depth (``scan_layers=True``). The default unrolls them
with one weight array per layer instead, because XLA materializes each scanned layer's
weight slice before its GEMMs, which costs a decode step 1.4-1.8x: Llama-3.1-8B shape,
batch 1, H200: 13.2 ms scanned vs 7.5 ms unrolled (the XLA flag
--xla_gpu_enable_dynamic_slice_fusion did not help: 12.8 ms); SmolLM2 on a 2-core CPU:
42.8 vs 30.4 ms (benchmarks/cpu_layer_loop.py). Unrolled programs compile in time
proportional to depth; GEMMs that read the stacked weight in place (pallas_kernels/matmul,
``layer=`` argument) are the way to get both.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxinfer.config import ConfigError, ModelConfig
from jaxinfer.layers.attention import AttentionBackend, AttentionMetadata, KVCache
from jaxinfer.layers.norm import rms_norm
from jaxinfer.layers.rope import inv_frequencies, rope_cos_sin
from jaxinfer.models.params import FP8_PROJECTIONS, check_params, fp8_names
from jaxinfer.quantization import fp8_weight_linear, quantize_params_fp8

_NO_WINDOW = 0


# Projections that read the same input run as one GEMM on a weight concatenated along its
# output axis at load time (TensorRT-LLM's fused QKV and gate-up; vLLM's QKVParallelLinear /
# MergedColumnParallelLinear): one weight read per input instead of three or two, and no
# skinny K/V GEMM, which XLA:GPU turns into a multiply + reduce at 0.8 TB/s (decode profile,
# H200, benchmarks/profile_decode.py). Per-channel FP8 scales concatenate the same way.
FUSED_PROJECTIONS = {"layers.wqkv": ("layers.wq", "layers.wk", "layers.wv"),
                     "layers.w_gate_up": ("layers.w_gate", "layers.w_up")}


def fuse_projections(params: dict) -> dict:
    """``{layers.wq, wk, wv, w_gate, w_up}`` -> ``{layers.wqkv, layers.w_gate_up}`` (and
    their ``*_scale``), concatenated on the last (output) axis: stacked [L, H, N] or one
    layer's [H, N]; numpy in, numpy out; device arrays in, device arrays out."""
    params = dict(params)
    for fused, parts in FUSED_PROJECTIONS.items():
        for suffix in ("", "_scale"):
            if parts[0] + suffix not in params:
                continue
            arrays = [params.pop(p + suffix) for p in parts]
            cat = np.concatenate if all(isinstance(a, np.ndarray) for a in arrays) \
                else jnp.concatenate
            params[fused + suffix] = cat(arrays, axis=-1)
    return params


def _as(name: str, value, dtype) -> jax.Array:
    """Device array in ``dtype``; FP8 weights and their float32 ``*_scale`` stay as they are."""
    value = jnp.asarray(value)
    if name.endswith("_scale") or value.dtype == jnp.float8_e4m3fn:
        return value
    return value.astype(dtype)


# SwiGLU and the down projection's per-token FP8 quantization as one kernel
# (row_quant.norm_quant_fp8(swiglu=True)) where the gate/up GEMM writes its [T, 2F] output
# (above fp8_plan.FP8_GATE_UP_EPILOGUE_MAX_M rows) and the down GEMM takes a quantized x:
# XLA's SwiGLU fusion and the quantization kernel were two CUDA-graph nodes and a [T, F]
# round trip. H200, 8B FP8 decode step at 64 rows (profile_decode, session 23 call 3, with
# row_quant's 16 warps / one pass): the fused kernel 155.4 µs a step vs 93.3 + 75.7 for the
# pair, device busy 4.276 vs 4.296 ms. Equal outputs either way
# (tests/engine/test_fp8_kernels.py).
FUSE_SWIGLU_QUANT = True


def _proj(h: jax.Array, w: dict[str, jax.Array], name: str, kernels: bool = False,
          interpret: bool = False, norm: jax.Array | None = None, eps: float = 0.0,
          gate_up: bool = False, unreduced: bool = False) -> jax.Array:
    """``h @ w[name]``, after ``rms_norm(h, norm, eps)`` when ``norm`` is given. FP8 weights:
    with ``kernels`` and a per-channel scale the weight is held as ``[N, K]`` and runs on the
    Pallas GEMMs the measured policy picks for the row count
    (pallas_kernels.matmul.fp8_plan.fp8_engine_linear: W8A8 on the Triton or Mosaic GPU
    kernels, W8A16 on XLA where none takes the shape); where that is the Triton decode GEMM
    the norm and the per-token quantization run as one kernel first
    (pallas_kernels.matmul.row_quant.norm_quant_fp8: one CUDA-graph node instead of XLA's
    two or three). Otherwise an FP8 weight is widened to h's dtype in an XLA GEMM (W8A16)
    and scaled per channel after it, or per group of input rows (block-FP8 checkpoints;
    jaxinfer.quantization.fp8_weight_linear). ``gate_up``: the FP8 kernels' ``[2F, K]``
    gate/up weight, returning ``silu(gate) * up`` (only with ``kernels``). ``unreduced``:
    a split-K Triton GEMM's ``SplitKPartials`` for the consumer to sum (the QKV projection:
    the attention backend's attend_qkv), else the array."""
    scale = w.get(name + "_scale")
    if kernels and scale is not None and scale.ndim == 1:
        from pallas_kernels.matmul.fp8_plan import fp8_takes_quantized_x
        from pallas_kernels.matmul.row_quant import norm_quant_fp8

        env = kernel_env_key()
        if fp8_takes_quantized_x(h.shape[0], h.shape[1], w[name].shape[0], gate_up):
            xq, xs = norm_quant_fp8(h, norm, eps, interpret=interpret)
            return _fp8_kernel_linear(xq, w[name], scale, gate_up=gate_up, interpret=interpret,
                                      x_scale=xs, out_dtype=h.dtype, env=env,
                                      unreduced=unreduced)
        h = h if norm is None else rms_norm(h, norm, eps)
        return _fp8_kernel_linear(h, w[name], scale, gate_up=gate_up, interpret=interpret,
                                  env=env, unreduced=unreduced)
    if gate_up:
        raise ValueError(f"_proj: gate_up needs the FP8 kernels and a per-channel scale ({name})")
    h = h if norm is None else rms_norm(h, norm, eps)
    if scale is None:
        return h @ w[name]
    return fp8_weight_linear(h, w[name], scale)


def _swiglu_quant_applies(T: int, w: dict[str, jax.Array]) -> bool:
    """Whether :data:`FUSE_SWIGLU_QUANT`'s path takes this layer's MLP at T rows: FP8
    kernel-layout gate/up ``[2F, H]`` and down ``[H, F]`` weights with per-channel scales,
    the gate/up SwiGLU not in the GEMM's epilogue, the down GEMM taking a quantized x."""
    from pallas_kernels.matmul import fp8_plan

    (F2, H), F = w["w_gate_up"].shape, w["w_down"].shape[1]
    return (FUSE_SWIGLU_QUANT and w.get("w_down_scale") is not None
            and w["w_down_scale"].ndim == 1 and F2 == 2 * F
            and not fp8_plan.fp8_gate_up_in_epilogue(T, H, F2)
            and fp8_plan.fp8_takes_quantized_x(T, H, F2)
            and fp8_plan.fp8_takes_quantized_x(T, F, w["w_down"].shape[0]))


def kernel_env_key() -> tuple[tuple[str, str], ...]:
    """The FP8 GEMM plan's environment switches in effect (``fp8_plan.env_values``), as a
    hashable static argument of :func:`_fp8_kernel_linear`: its trace cache outlives an
    engine, and the switches are read while tracing, so without it an engine built after a
    switch changed in the same process would reuse the traces made under the old value.
    Raises LinearError for a value a switch does not take (the engine checks at start)."""
    from pallas_kernels.matmul.fp8_plan import env_values

    return tuple(sorted(env_values().items()))


@functools.partial(jax.jit, static_argnames=("gate_up", "interpret", "out_dtype", "env",
                                             "unreduced"))
def _fp8_kernel_linear(h: jax.Array, w_nk: jax.Array, scale: jax.Array, gate_up: bool = False,
                       interpret: bool = False, x_scale: jax.Array | None = None,
                       out_dtype: jnp.dtype | None = None,
                       env: tuple[tuple[str, str], ...] = (),
                       unreduced: bool = False) -> jax.Array:
    """pallas_kernels.matmul.fp8_plan.fp8_engine_linear under its own ``jit``: the unrolled layers'
    calls of one shape share one traced and lowered function (XLA inlines it), so a kernel's
    Python lowering runs once per shape, not once per layer. Lowering a Mosaic GPU GEMM took
    0.4-1 s a call: an 8B prefill program with 128 of them compiled in ~130 s, not ~20 s.
    ``env``: :func:`kernel_env_key` where the call is traced (part of the trace cache key)."""
    from pallas_kernels.matmul.fp8_plan import fp8_engine_linear

    return fp8_engine_linear(h, w_nk, scale, gate_up=gate_up, interpret=interpret,
                             x_scale=x_scale, out_dtype=out_dtype or h.dtype,
                             unreduced=unreduced)


def _to_kernel_layout(weights: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """FP8 projections with per-channel scales ``[K, N]`` -> ``[N, K]`` (the layout the
    Pallas GEMMs stream: rows of K contiguous bytes; pallas_kernels.matmul.api); stacked
    ``[L, K, N]`` (scales ``[L, N]``, the scanned layers) -> ``[L, N, K]``. Block-scaled
    weights (scales with as many axes as the weight) stay as they are (XLA W8A16)."""
    out = dict(weights)
    for name, value in weights.items():
        scale = weights.get(name + "_scale")
        if (value.dtype == jnp.float8_e4m3fn and scale is not None
                and scale.ndim == value.ndim - 1):
            out[name] = jnp.swapaxes(value, -1, -2)
    return out


def model_options(ec) -> dict:
    """CausalLM keyword arguments from an EngineConfig: layer loop, quantization and the
    GEMM backend, ``matmul_backend="auto"`` resolved for this machine (the Pallas GEMMs on a
    GPU, XLA elsewhere; "pallas" off a GPU runs them in interpret mode)."""
    on_gpu = jax.default_backend() == "gpu"
    mm = ec.matmul_backend
    if mm == "auto":
        mm = "pallas" if on_gpu else "xla"
    return {"scan_layers": ec.scan_layers, "quantization": ec.quantization,
            "matmul_backend": mm, "interpret": mm == "pallas" and not on_gpu}


class CausalLM(nnx.Module):
    """Causal language model over the canonical weight layout of ``models/params.py``.

    Args:
      cfg: the architecture.
      params: ``{name: array}`` as produced by the loaders (checked against ``cfg``).
      dtype: weight and activation dtype (``jnp.float32`` or ``jnp.bfloat16``).
      quantization: "fp8" quantizes every projection on load
        (jaxinfer.quantization.quantize_params_fp8). Params that already carry FP8
        projections with scales (an FP8 checkpoint) run as they are with either value: the
        projections it left in float (its ignore list) stay float, as in vLLM.
      matmul_backend: "xla" (every GEMM through XLA) or "pallas" (FP8 projections with
        per-channel scales run on the Pallas GEMMs, see ``_proj``; bf16 ones stay on XLA,
        which measured faster than ours); ``interpret`` runs those kernels in Pallas
        interpret mode (CPU tests).
    Raises:
      WeightError: if a tensor is missing, extra or mis-shaped.
    """

    def __init__(self, cfg: ModelConfig, params: dict[str, np.ndarray],
                 dtype: jnp.dtype = jnp.float32, scan_layers: bool | None = None,
                 quantization: str | None = None, matmul_backend: str = "xla",
                 interpret: bool = False):
        check_params(cfg, params)
        if quantization not in (None, "fp8"):
            raise ConfigError(f"quantization must be None or 'fp8', got {quantization!r}")
        if matmul_backend not in ("xla", "pallas"):
            raise ConfigError(f"matmul_backend must be 'xla' or 'pallas', got {matmul_backend!r}")
        self.cfg = cfg
        self.dtype = dtype
        if scan_layers is None:  # XLA copies each scanned weight slice: unroll (see above)
            scan_layers = False
        self.scan_layers = scan_layers
        params = dict(params)
        if fp8_names(params):  # a checkpoint that carries FP8 weights runs them as they are
            quantization = "fp8"
        elif quantization == "fp8":  # quantize on load
            params = quantize_params_fp8(params, FP8_PROJECTIONS)
        self.quantization = quantization
        self.fp8_kernels = matmul_backend == "pallas" and quantization == "fp8"
        self.interpret = interpret
        stacked = {n: v for n, v in params.items() if n.startswith("layers.")}
        for name, value in params.items():
            if name not in stacked:
                setattr(self, name.replace(".", "__"), nnx.Param(_as(name, value, dtype)))
        # Projections fuse on the device after the dtype cast, one layer at a time when
        # unrolled: no host-side copy of the stacked weights.
        if scan_layers:
            per_layer = [("layers__", {n: _as(n, v, dtype) for n, v in stacked.items()})]
        else:  # layer{i}__wqkv: one array per layer
            per_layer = ((f"layer{i}__", {n: _as(n, v[i], dtype) for n, v in stacked.items()})
                         for i in range(cfg.num_layers))
        for prefix, weights in per_layer:
            weights = fuse_projections(weights)
            if self.fp8_kernels:
                weights = _to_kernel_layout(weights)
            for name, value in weights.items():
                setattr(self, prefix + name[len("layers."):], nnx.Param(value))

    def _layer_weights(self, prefix: str = "layers__") -> dict[str, jax.Array]:
        return {k[len(prefix):]: v[...] for k, v in vars(self).items() if k.startswith(prefix)}

    def _layer_constants(self) -> dict[str, jax.Array]:
        """Per-layer scan inputs that are not weights: index, window, rope choice."""
        cfg = self.cfg
        sliding = np.array([t == "sliding_attention" for t in cfg.layer_types])
        window = np.where(sliding, cfg.sliding_window or 0, _NO_WINDOW).astype(np.int32)
        local = sliding & (cfg.rope_local_base_freq is not None)
        if not self.scan_layers:  # static per-layer values for the unrolled loop
            return {"index": list(range(cfg.num_layers)), "window": window.tolist(),
                    "local_rope": local.tolist()}
        return {"index": jnp.arange(cfg.num_layers, dtype=jnp.int32),
                "window": jnp.asarray(window), "local_rope": jnp.asarray(local)}

    def __call__(self, token_ids: jax.Array, cache: KVCache, md: AttentionMetadata,
                 attn: AttentionBackend) -> tuple[jax.Array, KVCache]:
        """token_ids [T] int32 -> (final hidden states [T, H] after the last norm, cache)."""
        cfg = self.cfg
        x = self.embed[...][token_ids]
        if cfg.embed_scale != 1.0:
            x = x * jnp.asarray(cfg.embed_scale, self.dtype)  # HF casts the scale to dtype

        global_freq = jnp.asarray(inv_frequencies(cfg.head_dim, cfg.rope_theta,
                                                  cfg.rope_scaling))
        cos_g, sin_g = rope_cos_sin(md.positions, global_freq)
        if cfg.rope_local_base_freq is not None:
            local_freq = jnp.asarray(inv_frequencies(cfg.head_dim, cfg.rope_local_base_freq,
                                                     None))
            cos_l, sin_l = rope_cos_sin(md.positions, local_freq)
        else:
            cos_l, sin_l = cos_g, sin_g

        def layer(carry, xs):
            x, cache = carry
            w, c = xs
            if isinstance(c["local_rope"], bool):
                cos, sin = (cos_l, sin_l) if c["local_rope"] else (cos_g, sin_g)
            else:
                cos = jnp.where(c["local_rope"], cos_l, cos_g)
                sin = jnp.where(c["local_rope"], sin_l, sin_g)
            x, cache = self._block(x, cache, w, c, cos, sin, md, attn)
            return (x, cache), None

        consts = self._layer_constants()
        if self.scan_layers:
            (x, cache), _ = jax.lax.scan(layer, (x, cache), (self._layer_weights(), consts))
        else:
            for i in range(cfg.num_layers):
                c = {k: v[i] for k, v in consts.items()}
                (x, cache), _ = layer((x, cache), (self._layer_weights(f"layer{i}__"), c))
        return rms_norm(x, self.final_norm[...], cfg.rms_norm_eps), cache

    def _block(self, x, cache, w, c, cos, sin, md, attn):
        """One decoder layer: x [T, H] -> [T, H]."""
        cfg = self.cfg
        T = x.shape[0]
        eps = cfg.rms_norm_eps
        kern = (self.fp8_kernels, self.interpret)
        # (an FP8 split-K GEMM's partials unsummed: the backend's kernel may sum them itself)
        qkv = _proj(x, w, "wqkv", *kern, norm=w["attn_norm"], eps=eps, unreduced=True)
        # split, bias, QK norm, RoPE and the KV write: the backend's (on the Pallas backend's
        # decode steps one kernel, pallas_attention.ROPE_KV_WRITE_KERNEL)
        o, cache = attn.attend_qkv(
            qkv, cos, sin, cache, c["index"], md, num_heads=cfg.num_heads,
            scale=cfg.attn_scale, window=c["window"],
            bias=(w["bq"], w["bk"], w["bv"]) if cfg.attention_bias else None,
            q_norm=w["q_norm"] if cfg.qk_norm else None,
            k_norm=w["k_norm"] if cfg.qk_norm else None, eps=eps)
        o = _proj(o.reshape(T, cfg.q_size), w, "wo", *kern)
        if cfg.post_norms:
            o = rms_norm(o, w["post_attn_norm"], eps)
        x = x + o

        scale = w.get("w_gate_up_scale")
        fp8_gate_up = (kern[0] and cfg.hidden_act == "silu" and scale is not None
                       and scale.ndim == 1)
        if fp8_gate_up and _swiglu_quant_applies(T, w):
            # [T, 2F] from the GEMM, SwiGLU and the down input's quantization in one kernel
            from pallas_kernels.matmul.row_quant import norm_quant_fp8

            gate_up = _proj(x, w, "w_gate_up", *kern, norm=w["ffn_norm"], eps=eps)
            aq, a_scale = norm_quant_fp8(gate_up, swiglu=True, interpret=self.interpret)
            f = _fp8_kernel_linear(aq, w["w_down"], w["w_down_scale"],
                                   interpret=self.interpret, x_scale=a_scale,
                                   out_dtype=x.dtype, env=kernel_env_key())
        else:
            if fp8_gate_up:
                # the FP8 kernels' gate_up form: silu(gate) * up from the GEMM (in its
                # epilogue on the Triton decode GEMM), not a [T, 2F] round trip
                act_up = _proj(x, w, "w_gate_up", *kern, norm=w["ffn_norm"], eps=eps,
                               gate_up=True)
            else:
                gate, up = jnp.split(_proj(x, w, "w_gate_up", *kern, norm=w["ffn_norm"],
                                           eps=eps), 2, axis=-1)
                if cfg.hidden_act == "silu":
                    act = jax.nn.silu(gate)
                else:
                    act = jax.nn.gelu(gate, approximate=True)
                act_up = act * up
            f = _proj(act_up, w, "w_down", *kern)
        if cfg.post_norms:
            f = rms_norm(f, w["post_ffn_norm"], eps)
        return x + f, cache

    def logits(self, hidden: jax.Array) -> jax.Array:
        """hidden [N, H] -> logits [N, V] float32 (tied to the embedding when configured)."""
        if self.cfg.tie_word_embeddings:
            # Contract with the embedding's hidden axis directly: `hidden @ embed.T` makes
            # XLA:CPU materialize the transpose (measured 6x slower for SmolLM2's 49152x576).
            dims = (((1,), (1,)), ((), ()))
            return jax.lax.dot_general(hidden, self.embed[...], dims,
                                       preferred_element_type=jnp.float32)
        return jnp.dot(hidden, self.lm_head[...], preferred_element_type=jnp.float32)
