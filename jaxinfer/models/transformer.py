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

import contextlib
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxinfer.config import ConfigError, ModelConfig
from jaxinfer.layers.attention import AttentionBackend, AttentionMetadata, KVCache
from jaxinfer.layers.norm import rms_norm
from jaxinfer.layers.rope import inv_frequencies, rope_cos_sin
from jaxinfer.models.params import FP8_PROJECTIONS, check_params, fp8_names
from jaxinfer.models.projection import fp8_kernel_linear as _fp8_kernel_linear
from jaxinfer.models.projection import kernel_env_key
from jaxinfer.models.projection import project as _proj
from jaxinfer.models.projection import reduced as _reduced
from jaxinfer.models.projection import to_kernel_layout as _to_kernel_layout
from jaxinfer.quantization import quantize_params_fp8

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
# The o and down projections' split-K partials summed inside the next norm_quant_fp8 with the
# residual add (the gate/up site's, and the next layer's QKV site's with unrolled layers)
# instead of XLA's epilogue + add fusion (2 launches a layer: 8B FP8 decode, 142 µs a step at
# 64 rows, 100 at 1 row, session 24's profiles). Session 23 moved only the add (no gain: the
# sum stayed a fusion). FP8 kernels without post-norms. Off until timed on the GPU.
FUSE_SPLITK_RESIDUAL = False


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


def matmul_precision(dtype) -> Any:
    """The context a ``dtype`` model traces its programs under: float32 models multiply in
    float32 (``jax.default_matmul_precision("highest")``), bf16 ones at JAX's default.

    With JAX's default precision XLA:GPU runs float32 dots as TF32 (10-bit mantissa): the
    float32 engine's hidden states were ~7e-3 from HF transformers' float32 ones on an H100
    (session 40), where PyTorch multiplies float32 in float32 by default
    (``torch.backends.cuda.matmul.allow_tf32`` is False). On the CPU float32 dots are float32
    either way. An explicit ``jax_default_matmul_precision`` (the environment's
    ``JAX_DEFAULT_MATMUL_PRECISION``, say "tensorfloat32" for speed) wins.
    """
    if jnp.dtype(dtype) == jnp.float32 and jax.config.jax_default_matmul_precision is None:
        return jax.default_matmul_precision("highest")
    return contextlib.nullcontext()


def _at_model_precision(method: Any) -> Any:
    """``method`` of a CausalLM traced under :func:`matmul_precision` of its dtype (every path
    that traces the model's dots: ``__call__``, ``logits``, ``_block``, which GPTQ calls alone)."""
    @functools.wraps(method)
    def traced(self: Any, *args: Any, **kwargs: Any) -> Any:
        with matmul_precision(self.dtype):
            return method(self, *args, **kwargs)

    return traced


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

    @_at_model_precision
    def __call__(self, token_ids: jax.Array, cache: KVCache, md: AttentionMetadata,
                 attn: AttentionBackend, *, hook: Any = None, collect: bool = False) -> Any:
        """token_ids [T] int32 -> (final hidden states [T, H] after the last norm, cache).

        Research (jaxinfer/research.py): ``hook(layer, x) -> x`` (a jnp function; ``layer``
        an int, or a traced int32 with scanned layers) replaces each layer's output [T, H]
        (the residual stream) before the next layer reads it; ``collect`` returns
        ``(hidden, cache, states)``, states [L + 1, T, H]: the embeddings, then each layer's
        output (after the hook). float32 models trace under :func:`matmul_precision`."""
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

        # FUSE_SPLITK_RESIDUAL with unrolled layers: each layer hands its MLP output f to the
        # next unadded (a split-K GEMM's partials), the next layer's QKV norm-quant adds it
        # (x + f is that layer's input); the final norm's input adds the last one
        fuse = self._fuse_splitk_residual()
        # (a hook or collect needs each layer's whole output: no unadded MLP output carried)
        carry_f = fuse and not self.scan_layers and hook is None and not collect

        def layer(carry, xs):
            x, f, cache = carry
            w, c = xs
            if isinstance(c["local_rope"], bool):
                cos, sin = (cos_l, sin_l) if c["local_rope"] else (cos_g, sin_g)
            else:
                cos = jnp.where(c["local_rope"], cos_l, cos_g)
                sin = jnp.where(c["local_rope"], sin_l, sin_g)
            if carry_f:
                x, f, cache = self._block(x, cache, w, c, cos, sin, md, attn, pending=f,
                                          carry_f=True, fuse=True)
            else:  # (the plain call: quantization_gptq records and replays it)
                x, cache = self._block(x, cache, w, c, cos, sin, md, attn,
                                       **({"fuse": True} if fuse else {}))
            if hook is not None:
                y = jnp.asarray(hook(c["index"], x))
                if y.shape != x.shape:
                    raise ValueError(f"hook returned shape {y.shape} for layer output shape "
                                     f"{x.shape}; it must return the residual stream's")
                x = y.astype(x.dtype)
            return (x, f, cache), (x if collect else None)

        consts = self._layer_constants()
        x0 = x
        if self.scan_layers:
            (x, _, cache), states = jax.lax.scan(layer, (x, None, cache),
                                                 (self._layer_weights(), consts))
        else:
            f, outs = None, []
            for i in range(cfg.num_layers):
                c = {k: v[i] for k, v in consts.items()}
                (x, f, cache), out = layer((x, f, cache),
                                           (self._layer_weights(f"layer{i}__"), c))
                outs.append(out)
            x = x if f is None else x + _reduced(f)
            states = jnp.stack(outs) if collect else None
        hidden = rms_norm(x, self.final_norm[...], cfg.rms_norm_eps)
        if collect:
            return hidden, cache, jnp.concatenate([x0[None], states])
        return hidden, cache

    def _fuse_splitk_residual(self) -> bool:
        """Whether :data:`FUSE_SPLITK_RESIDUAL` applies: FP8 kernels, no post-norms (Gemma 3
        norms o and f before the add)."""
        return FUSE_SPLITK_RESIDUAL and self.fp8_kernels and not self.cfg.post_norms

    @_at_model_precision
    def _block(self, x, cache, w, c, cos, sin, md, attn, *, pending=None, carry_f=False,
               fuse=False):
        """One decoder layer: x [T, H] -> ``(x', cache)``. With ``carry_f`` the layer's input
        is ``x + pending`` (``pending`` the previous layer's MLP output not yet added, or
        None) and it returns ``(x', f, cache)``, its output ``x' + f`` with f unadded (a
        split-K GEMM's partials, or an array). ``fuse``: the o projection's partials go to the
        gate/up norm-quant unadded (FUSE_SPLITK_RESIDUAL)."""
        cfg = self.cfg
        T = x.shape[0]
        eps = cfg.rms_norm_eps
        kern = (self.fp8_kernels, self.interpret)
        # (an FP8 split-K GEMM's partials unsummed: the backend's kernel may sum them itself)
        qkv = _proj(x, w, "wqkv", *kern, norm=w["attn_norm"], eps=eps, unreduced=True,
                    residual=pending)
        if pending is not None:
            qkv, x = qkv
        # split, bias, QK norm, RoPE and the KV write: the backend's (on the Pallas backend's
        # decode steps one kernel, pallas_attention.ROPE_KV_WRITE_KERNEL)
        o, cache = attn.attend_qkv(
            qkv, cos, sin, cache, c["index"], md, num_heads=cfg.num_heads,
            scale=cfg.attn_scale, window=c["window"],
            bias=(w["bq"], w["bk"], w["bv"]) if cfg.attention_bias else None,
            q_norm=w["q_norm"] if cfg.qk_norm else None,
            k_norm=w["k_norm"] if cfg.qk_norm else None, eps=eps)
        o = _proj(o.reshape(T, cfg.q_size), w, "wo", *kern, unreduced=fuse)
        if cfg.post_norms:
            o = rms_norm(o, w["post_attn_norm"], eps)
        if not fuse:
            x, o = x + o, None
        x, f = self._mlp(x, o, w, carry_f)
        if carry_f:
            return x, f, cache
        return x + _reduced(f), cache

    def _mlp(self, x, mid, w, unreduced: bool):
        """The MLP half: ``h = x + mid`` (``mid`` the o projection's unadded output, or None:
        x is h) -> ``(h, f)``, f the down projection's output (its split-K partials where
        ``unreduced`` and the GEMM splits)."""
        cfg = self.cfg
        T = x.shape[0]
        eps = cfg.rms_norm_eps
        kern = (self.fp8_kernels, self.interpret)

        def gate_up_proj(**kw):  # (out, h): the gate/up projection of h = x + mid
            out = _proj(x, w, "w_gate_up", *kern, norm=w["ffn_norm"], eps=eps, residual=mid,
                        **kw)
            return out if mid is not None else (out, x)

        scale = w.get("w_gate_up_scale")
        fp8_gate_up = (kern[0] and cfg.hidden_act == "silu" and scale is not None
                       and scale.ndim == 1)
        if fp8_gate_up and _swiglu_quant_applies(T, w):
            # [T, 2F] from the GEMM, SwiGLU and the down input's quantization in one kernel
            from pallas_kernels.matmul.row_quant import norm_quant_fp8

            gate_up, x = gate_up_proj()
            aq, a_scale = norm_quant_fp8(gate_up, swiglu=True, interpret=self.interpret)
            f = _fp8_kernel_linear(aq, w["w_down"], w["w_down_scale"],
                                   interpret=self.interpret, x_scale=a_scale,
                                   out_dtype=x.dtype, env=kernel_env_key(),
                                   unreduced=unreduced)
        else:
            if fp8_gate_up:
                # the FP8 kernels' gate_up form: silu(gate) * up from the GEMM (in its
                # epilogue on the Triton decode GEMM), not a [T, 2F] round trip
                act_up, x = gate_up_proj(gate_up=True)
            else:
                gate_up, x = gate_up_proj()
                gate, up = jnp.split(gate_up, 2, axis=-1)
                if cfg.hidden_act == "silu":
                    act = jax.nn.silu(gate)
                else:
                    act = jax.nn.gelu(gate, approximate=True)
                act_up = act * up
            f = _proj(act_up, w, "w_down", *kern, unreduced=unreduced)
        if cfg.post_norms:
            f = rms_norm(f, w["post_ffn_norm"], eps)
        return x, f

    @_at_model_precision
    def logits(self, hidden: jax.Array) -> jax.Array:
        """hidden [N, H] -> logits [N, V] float32 (tied to the embedding when configured)."""
        if self.cfg.tie_word_embeddings:
            # Contract with the embedding's hidden axis directly: `hidden @ embed.T` makes
            # XLA:CPU materialize the transpose (measured 6x slower for SmolLM2's 49152x576).
            dims = (((1,), (1,)), ((), ()))
            return jax.lax.dot_general(hidden, self.embed[...], dims,
                                       preferred_element_type=jnp.float32)
        return jnp.dot(hidden, self.lm_head[...], preferred_element_type=jnp.float32)
