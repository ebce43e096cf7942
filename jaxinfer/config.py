"""Model and engine configuration.

`ModelConfig` describes the network (read from an HF ``config.json`` or from GGUF metadata);
`EngineConfig` describes how the engine runs it (page size, page count, buckets, dtypes).
Both are frozen dataclasses whose checks live in ``__post_init__`` (as in nano-vllm).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any

# Families the engine implements. "llama" covers Llama 3/3.1, Mistral, Qwen2, Qwen3 and
# SmolLM2 through config flags (attention_bias, qk_norm, rope_scaling).
FAMILIES = ("llama", "gemma3")
# EngineConfig.kv_cache_dtype values (vLLM's names): "auto" = the model dtype; "fp8" and
# "fp8_e4m3" both mean float8_e4m3fn with per-layer K/V scales.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")


class ConfigError(ValueError):
    """A model or engine configuration value is missing or out of range.

    ``field`` names the offending ModelConfig field (``"rope_scaling.factor"`` for a key of
    ``rope_scaling``) when there is one, and ``problem`` says what is wrong with it, so a
    loader can restate the error with the name the checkpoint uses for that field (an HF
    ``config.json`` key, a GGUF metadata key).
    """

    def __init__(self, message: str, field: str | None = None, problem: str = "") -> None:
        super().__init__(message)
        self.field = field
        self.problem = problem


def field_error(name: str, problem: str) -> ConfigError:
    """``ConfigError("<name> <problem>")`` that remembers the field and the problem."""
    return ConfigError(f"{name} {problem}", field=name, problem=problem)


def check_positive_int(name: str, v: Any) -> int:
    """``v`` if it is an int > 0 (not a bool); else a ConfigError naming ``name``."""
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise field_error(name, f"must be a positive integer, got {v!r}")
    return v


def check_positive_number(name: str, v: Any) -> float:
    """``float(v)`` if ``v`` is a finite number > 0 (not a bool); else a ConfigError."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise field_error(name, f"must be a positive finite number, got {v!r}")
    return float(v)


# What each RoPE scaling type reads (jaxinfer/layers/rope.py), all positive numbers.
ROPE_SCALING_KEYS = {"default": (), "linear": ("factor",),
                     "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                                "original_max_position_embeddings")}


def check_rope_scaling(scaling: dict[str, Any], prefix: str = "rope_scaling") -> None:
    """Raise ConfigError (field ``<prefix>.<key>``) for an unknown RoPE type or a missing,
    non-finite or non-positive number that type needs (Llama 3 also needs
    ``high_freq_factor > low_freq_factor``: rope.py divides by their difference)."""
    if not isinstance(scaling, dict):
        raise field_error(prefix, f"must be a dict, got {scaling!r}")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ROPE_SCALING_KEYS:
        raise field_error(f"{prefix}.rope_type", f"{kind!r} is not supported (supported: "
                                                 f"{', '.join(ROPE_SCALING_KEYS)})")
    for key in ROPE_SCALING_KEYS[kind]:
        if key not in scaling:
            raise field_error(f"{prefix}.{key}", f"is missing (RoPE type {kind!r} needs it)")
        check_positive_number(f"{prefix}.{key}", scaling[key])
    if kind == "llama3" and scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
        raise field_error(f"{prefix}.high_freq_factor",
                          f"must be greater than low_freq_factor ({scaling['low_freq_factor']!r}"
                          f"), got {scaling['high_freq_factor']!r}")


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder-only transformer.

    Attributes use HF transformers' meaning. ``layer_types`` holds one entry per layer,
    ``"full_attention"`` or ``"sliding_attention"`` (the latter uses ``sliding_window`` and,
    for Gemma 3, ``rope_local_base_freq``). Norm weights are always applied as ``x * w``
    (Gemma's "+1" is folded into the weights at load time).
    """

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    hidden_act: str = "silu"
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    rope_local_base_freq: float | None = None
    query_pre_attn_scalar: float | None = None
    embed_scale: float = 1.0
    post_norms: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = ""
    # The SamplingParams fields the checkpoint's generation_config.json sets by default
    # (jaxinfer.sampling_defaults; vLLM's --generation-config auto): no program depends on them.
    sampling_defaults: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ConfigError(f"unknown model family {self.family!r}; supported: {FAMILIES}")
        for f in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                  "num_kv_heads", "head_dim", "max_position_embeddings"):
            check_positive_int(f, getattr(self, f))
        for f in ("rms_norm_eps", "rope_theta", "embed_scale"):
            check_positive_number(f, getattr(self, f))
        for f in ("rope_local_base_freq", "query_pre_attn_scalar"):
            if getattr(self, f) is not None:
                check_positive_number(f, getattr(self, f))
        if self.sliding_window is not None:
            check_positive_int("sliding_window", self.sliding_window)
        if self.rope_scaling is not None:
            check_rope_scaling(self.rope_scaling)
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})")
        if not self.layer_types:
            kind = "sliding_attention" if self.sliding_window else "full_attention"
            object.__setattr__(self, "layer_types", (kind,) * self.num_layers)
        if len(self.layer_types) != self.num_layers:
            raise ConfigError(
                f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        bad = set(self.layer_types) - {"full_attention", "sliding_attention"}
        if bad:
            raise ConfigError(f"unknown layer types {sorted(bad)}")
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise ConfigError("sliding_attention layers need sliding_window > 0")
        if self.hidden_act not in ("silu", "gelu_pytorch_tanh"):
            raise ConfigError(f"unsupported hidden_act {self.hidden_act!r}")
        object.__setattr__(self, "eos_token_ids", tuple(int(t) for t in self.eos_token_ids))

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def attn_scale(self) -> float:
        """Softmax scale: 1/sqrt(query_pre_attn_scalar) for Gemma 3, else 1/sqrt(head_dim)."""
        return 1.0 / math.sqrt(self.query_pre_attn_scalar or self.head_dim)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "ModelConfig":
        d = json.loads(text)
        d["layer_types"] = tuple(d.get("layer_types", ()))
        d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
        return cls(**d)

    def replace(self, **kw: Any) -> "ModelConfig":
        return dataclasses.replace(self, **kw)


def _pow2_buckets(lo: int, hi: int) -> tuple[int, ...]:
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= 2
    out.append(hi)
    return tuple(sorted(set(out)))


@dataclass(frozen=True)
class EngineConfig:
    """How the engine runs a model (names follow vLLM where the concept is the same).

    Attributes:
      max_model_len: longest sequence (prompt + output) in tokens, >= 2.
      block_size: tokens per KV page.
      num_kv_pages: pages in the device pool, the reserved null page 0 included. ``None``
        sizes the pool from memory (``jaxinfer/kv_sizing.py``): on an accelerator
        ``gpu_memory_utilization`` of XLA's memory limit after weights and the largest
        buckets' activations; on the CPU what ``max_num_seqs`` sequences of
        ``max_model_len`` tokens need (``total_kv_pages``), capped by that fraction of RAM.
      gpu_memory_utilization: fraction (0, 1] of device memory (CPU: available RAM) the
        engine may use, weights and activations included (vLLM's name).
      max_num_seqs: most sequences running at once (also the largest decode bucket).
      max_num_batched_tokens: most tokens in one prefill step (largest prefill bucket).
      max_prefill_seqs: most sequences packed into one prefill step. The defaults of these
        three (8, 512, 8) are the CPU's; an engine on a GPU that is not given them uses
        256, 8192 and 64 (``engine_config.GPU_DEFAULTS``).
      decode_buckets / prefill_buckets: compiled batch sizes / packed token counts; derived
        from the limits above when empty (powers of two up to the limit).
      page_buckets: compiled block-table widths in pages (powers of two from 16 pages up to
        max_pages_per_seq when empty); short contexts run in narrow programs. With the Pallas
        kernels (which read only a sequence's own pages) the engine defaults to the one
        width max_pages_per_seq: see ``engine_config.engine_config_for``. The largest
        must equal max_pages_per_seq (ConfigError otherwise).
      prefill_seq_buckets: sequence rows of the prefill programs (powers of two up to
        max_prefill_seqs when empty; the Pallas default is max_prefill_seqs alone).
      dtype: activation and weight dtype ("float32" or "bfloat16"); "auto" picks float32 on
        CPU and bfloat16 on accelerators.
      attention_backend: "auto" (the Pallas kernels on GPU, with the Mosaic GPU prefill
        kernel on Hopper: "pallas_mgpu"; the reference elsewhere), "reference", "pallas"
        (Triton kernels only), "pallas_decode", "pallas_mgpu".
      scan_layers: True runs the layers under ``lax.scan`` (compile time independent of
        depth); False/None (default) unrolls them, one weight array per layer: XLA copies
        scanned weight slices, measured 13.2 vs 7.5 ms per 8B decode step on an H200 and
        42.8 vs 30.4 ms per SmolLM2 step on a 2-core CPU (benchmarks/cpu_layer_loop.py).
      quantization: None, or "fp8" to quantize the projection weights on load to
        float8_e4m3fn with per-output-channel scales.
      matmul_backend: "auto" (the Pallas GEMMs for FP8 projections on GPU, XLA elsewhere),
        "xla", or "pallas" (on CPU: interpret mode, for tests). With the Pallas GEMMs FP8
        projections run W8A8 (activations quantized per token) on the Triton kernel up to
        64 rows and on the Mosaic GPU kernels above, W8A16 on XLA only where no kernel
        takes the shape (pallas_kernels.matmul.fp8_plan.fp8_engine_plan); bf16 projections
        always run on XLA.
      kv_cache_dtype: dtype of the paged KV cache (vLLM's ``--kv-cache-dtype``): "auto" (the
        model dtype) or "fp8" / "fp8_e4m3" (float8_e4m3fn with one K and one V scale per
        layer, half the bytes of bf16, so twice the tokens fit; see
        ``jaxinfer/layers/attention.py`` for the scale scheme).
      enable_prefix_caching: reuse the KV pages of full prompt pages already computed
        (hash-chained, LRU-evicted; see block_manager.py).
      max_consecutive_prefills: prefill steps in a row before running decodes get a step
        (None = prefill first; see scheduler.py).
      max_queue_len: most waiting requests; ``add_request`` beyond it raises
        ``scheduler.QueueFullError``. None = unbounded.
      seed: base seed for requests that do not set their own.
      async_scheduling: overlap the host with the device (vLLM's ``--async-scheduling``):
        a pure-decode step is dispatched before the previous step's tokens are read back,
        its input tokens gathered from that step's device output (see engine_async.py for
        which steps pipeline, also while requests wait that could not be admitted). Outputs
        equal the synchronous engine's; with a waiting queue, a request that stops by EOS or
        a stop token/string is seen one step late, so the request waiting for its place is
        admitted one step later (as in vLLM's async scheduler). On by default since
        it measured faster on the H200 (8B bf16 TPOT 6.25 -> 4.76 ms at batch 1, 8.02 -> 5.80
        ms at 64 streams; benchmarks/RESULTS.md); False = the synchronous engine.
      jump_forward: jump-forward decoding of structured outputs (SGLang's; Zheng et al.
        2024, arXiv 2312.07104; jaxinfer/jump_forward.py): after a constrained row samples a
        token, the tokens its grammar then forces (a JSON key, ``":"``, a closing ``"}``)
        are appended without sampling them, and the next prefill step computes them all
        and samples the token after them: one step for several tokens. Rows jump only
        when no other row would wait for that prefill step (every decoding row jumps, or a
        prefill step comes next anyway); rows with ``logprobs``, penalties, ``bad_words``,
        ``logit_bias`` or ``allowed_token_ids`` never do. Greedy text follows the grammar
        either way, but the token ids may differ (the forced text is tokenized
        canonically, not as the model would have split it), so it is off by default;
        measured 1.75x output tok/s for one 8B FP8 row of compact JSON on an H100, 1.10x
        for 8 rows (benchmarks/RESULTS.md "Jump-forward decoding").
      num_scheduler_steps: decode steps run by one compiled program (vLLM's multi-step
        scheduling, ``--num-scheduler-steps``): when every running sequence decodes and
        none asks for logprobs, k steps run on the device, each feeding its sampled tokens
        to the next, and the host reads k tokens a row back at once, so the host's launch
        and Python cost is paid once per k tokens (see multi_step.py). Tokens and finish
        reasons equal the one-step engine's; a row that stops mid-window wastes the rest of
        its window; streams receive tokens k at a time. With ``async_scheduling`` the next
        window is dispatched before the last is read back (engine_multi.py). 1 = off (the
        default).
    """

    max_model_len: int = 2048
    block_size: int = 16
    num_kv_pages: int | None = None
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 512
    max_prefill_seqs: int = 8
    decode_buckets: tuple[int, ...] = ()
    prefill_buckets: tuple[int, ...] = ()
    page_buckets: tuple[int, ...] = ()
    prefill_seq_buckets: tuple[int, ...] = ()
    dtype: str = "auto"
    attention_backend: str = "auto"
    scan_layers: bool | None = None
    quantization: str | None = None
    matmul_backend: str = "auto"
    kv_cache_dtype: str = "auto"
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    max_consecutive_prefills: int | None = 1
    max_queue_len: int | None = None
    seed: int = 0
    async_scheduling: bool = True
    num_scheduler_steps: int = 1
    jump_forward: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        def pos(name: str) -> None:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {v!r}")

        for name in ("max_model_len", "block_size", "max_num_seqs", "max_num_batched_tokens",
                     "max_prefill_seqs", "num_scheduler_steps"):
            pos(name)
        if self.max_model_len < 2:  # (serve --max-model-len 1 started, then refused all)
            raise ConfigError(f"max_model_len must be at least 2 (a prompt token and a new "
                              f"one), got {self.max_model_len}", field="max_model_len")
        if self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a power of two, got {self.block_size}")
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise ConfigError(f"dtype must be 'auto', 'float32' or 'bfloat16', got {self.dtype!r}")
        if self.attention_backend not in ("auto", "reference", "pallas", "pallas_decode",
                                          "pallas_mgpu"):
            raise ConfigError(
                f"attention_backend must be 'auto', 'reference', 'pallas', 'pallas_decode' or "
                f"'pallas_mgpu', got {self.attention_backend!r}")
        if not self.decode_buckets:
            object.__setattr__(self, "decode_buckets", _pow2_buckets(1, self.max_num_seqs))
        if not self.prefill_buckets:
            lo = min(16, self.max_num_batched_tokens)
            object.__setattr__(self, "prefill_buckets",
                               _pow2_buckets(lo, self.max_num_batched_tokens))
        if not self.prefill_seq_buckets:
            object.__setattr__(self, "prefill_seq_buckets",
                               _pow2_buckets(1, self.max_prefill_seqs))
        if not self.page_buckets:
            object.__setattr__(self, "page_buckets",
                               _pow2_buckets(min(16, self.max_pages_per_seq),
                                             self.max_pages_per_seq))
        for name in ("decode_buckets", "prefill_buckets", "page_buckets",
                     "prefill_seq_buckets"):
            vals = getattr(self, name)
            if any(not isinstance(b, int) or b <= 0 for b in vals):
                raise ConfigError(f"{name} must hold positive integers, got {vals!r}")
            object.__setattr__(self, name, tuple(sorted(set(vals))))
        if self.page_buckets[-1] > self.max_pages_per_seq:  # --page-buckets 1000000: a
            # [rows, 10**6] block table every step, for pages no sequence can own
            raise ConfigError(f"page_buckets {self.page_buckets!r}: a block table never needs "
                              f"more than the {self.max_pages_per_seq} pages of one "
                              f"max_model_len ({self.max_model_len}) sequence",
                              field="page_buckets")
        if self.page_buckets[-1] < self.max_pages_per_seq:
            raise ConfigError(f"the largest page bucket ({self.page_buckets[-1]} pages) must hold "
                              f"max_model_len tokens ({self.max_pages_per_seq} pages)")
        object.__setattr__(self, "decode_buckets", tuple(sorted(set(self.decode_buckets))))
        object.__setattr__(self, "prefill_buckets", tuple(sorted(set(self.prefill_buckets))))
        if self.decode_buckets[-1] < self.max_num_seqs:
            raise ConfigError(f"the largest decode bucket ({self.decode_buckets[-1]}) must hold "
                              f"max_num_seqs ({self.max_num_seqs}) sequences")
        if self.prefill_buckets[-1] < self.max_num_batched_tokens:
            raise ConfigError(f"the largest prefill bucket ({self.prefill_buckets[-1]}) must "
                              f"hold max_num_batched_tokens ({self.max_num_batched_tokens})")
        if self.prefill_seq_buckets[-1] < self.max_prefill_seqs:
            raise ConfigError(f"the largest prefill_seq_bucket ({self.prefill_seq_buckets[-1]}) "
                              f"must hold max_prefill_seqs ({self.max_prefill_seqs})")
        if self.quantization not in (None, "fp8"):
            raise ConfigError(f"quantization must be None or 'fp8', got {self.quantization!r}")
        if self.matmul_backend not in ("auto", "xla", "pallas"):
            raise ConfigError("matmul_backend must be 'auto', 'xla' or 'pallas', got "
                              f"{self.matmul_backend!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            hint = (" (e5m2 is not implemented: the attention kernels read e4m3)"
                    if self.kv_cache_dtype == "fp8_e5m2" else "")
            raise ConfigError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                              f"got {self.kv_cache_dtype!r}{hint}")
        n = self.num_kv_pages
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 2):
            raise ConfigError(f"num_kv_pages must be an integer of at least 2, got {n!r}")
        u = self.gpu_memory_utilization
        if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0 < u <= 1:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {u!r}")
        for name in ("max_consecutive_prefills", "max_queue_len"):
            if getattr(self, name) is not None:
                pos(name)
        s = self.seed  # numpy's SeedSequence takes ints >= 0 only, and names no option
        if isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < 2**63:
            raise ConfigError(f"seed must be an integer in [0, 2**63), got {s!r}")
        for name in ("enable_prefix_caching", "async_scheduling", "scan_layers",
                     "jump_forward"):
            v = getattr(self, name)  # a string such as "false" would be taken as True
            if not isinstance(v, bool) and not (v is None and name == "scan_layers"):
                raise ConfigError(f"{name} must be True or False, got {v!r}")

    @property
    def max_pages_per_seq(self) -> int:
        """Width of a block table: pages needed by one sequence of max_model_len tokens."""
        return -(-self.max_model_len // self.block_size)

    @property
    def total_kv_pages(self) -> int:
        """Pages in the device pool, null page 0 included: ``num_kv_pages``, else what
        ``max_num_seqs`` sequences of ``max_model_len`` tokens need (the engine may size the
        pool from memory instead: ``LLMEngine.kv_sizing``)."""
        if self.num_kv_pages is not None:
            return self.num_kv_pages
        return self.max_num_seqs * self.max_pages_per_seq + 1
