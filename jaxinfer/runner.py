"""The model runner: compiled step programs keyed by bucket, the device KV pool, sampling.

Each bucket (see ``batch.Bucket``) is lowered and compiled once, ahead of time, with the KV
pool donated so page writes happen in place. ``num_compilations`` counts programs compiled by
XLA so tests can assert that serving compiles nothing after warm-up; ``num_loaded`` counts
programs loaded instead (from a ``jaxinfer compile`` cache set as ``program_store``, from
JAX's persistent compilation cache, or, for the model-independent programs, from an earlier
runner of this process: see ``_SHARED``).

A sample step is two programs, dispatched back to back (no host round trip between them):
the model program of the step's bucket, which returns the [S, V] float32 logits of the rows
that sample (``md.logits_indices``), and a sampler program of S rows, which samples them
(``sampling.sample_rows``). The sampler is compiled in a few variants
(``sampling.SAMPLER_VARIANTS``), each with static flags for the parts it runs, so neither
program has a device-side conditional (on XLA:GPU each ``lax.cond`` blocks the host until the
device reaches it, and splits command buffers); each step the runner picks the variant from
the host copy of the step's parameters (``sampling.sampler_variant``). Building the model
program of a sample bucket also builds every sampler variant of its S, so a step compiles
nothing that an earlier step of the same bucket did not, whatever its parameters.

Besides the KV pool the runner holds the sampling penalty state, ``counts`` [num_slots + 1, V]
int32 (see ``sampling.py``), donated to every sampler program like the pool to the model
program, a small "history" program that loads one slot's row from a sequence's tokens, the
per-slot ``logit_bias`` and ``bad_words`` tables (``sampling_penalties.LogitBias``, donated to
the sampler, which appends each token of a row with a table to its slot's last outputs) and a
"bias" program that loads one slot's tables, a "mask" program that sets the allowed-token
flags of structured-outputs rows before a step (``load_allowed_masks``), and a "copy" program
that copies KV pages for the copy-on-write of forked ``n > 1`` samples
(``layers/page_copy.py``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxinfer.batch import Bucket, SamplingArrays, StepInputs
from jaxinfer.compile_cache import KeyLocks, xla_compilations
from jaxinfer.layers.attention import AttentionBackend, AttentionMetadata, allocate_kv_cache
from jaxinfer.layers.page_copy import copy_pages
from jaxinfer.models.transformer import CausalLM
from jaxinfer.runner_slots import BIAS, HISTORY, MASK, SlotStateLoaders
from jaxinfer.sampling import (
    SAMPLER_VARIANTS,
    SampleOutput,
    SamplerNeeds,
    sample_rows,
    sampler_bucket,
    sampler_variant,
)
from jaxinfer.sampling_penalties import (
    STOP_IDS_PER_CALL,
    LogitBias,
    load_allowed_masks,
    load_logit_bias,
    load_token_history,
)

log = logging.getLogger(__name__)

# Modes of a compiled step: sample one token per row (the model program, then a SAMPLER
# program), or return every token's logits (research / parity checks / prompt logprobs).
# SAMPLER programs have buckets ``sampling.sampler_bucket(S, variant)``. COPY is not a step:
# it copies KV pages (``copy_pages``); its bucket is ``copy_bucket``. HISTORY and BIAS load
# one slot's sampling state (runner_slots.py).
SAMPLE, LOGITS, SAMPLER, COPY = "sample", "logits", "sampler", "copy"
# GATHER is not a step either: it takes a decode step's input tokens from the previous step's
# sampled tokens on the device (``gather_tokens``, async scheduling); its bucket is
# ``gather_bucket(S)``, one per decode batch bucket.
GATHER = "gather"


def gather_bucket(num_seqs: int) -> Bucket:
    """Bucket of the token-gather program of a decode step of ``num_seqs`` rows."""
    return Bucket(GATHER, num_seqs, num_seqs, 0)


def _gather_tokens(tokens: jax.Array, rows: jax.Array) -> jax.Array:
    """tokens [S] int32 (a step's samples), rows [S] int32 in [0, S) -> tokens[rows]."""
    return jnp.take(tokens, rows, mode="clip")


class SampleResult(NamedTuple):
    """Host copy of a sample step's output; rows past the real ones are padding.

    Attributes:
      tokens: [S] int32 sampled tokens.
      logprobs / top_ids / top_logprobs: [S], [S, K], [S, K] (see ``sampling.SampleOutput``);
        None when no row of the step asked for logprobs (not copied to the host).
    """

    tokens: np.ndarray
    logprobs: np.ndarray | None = None
    top_ids: np.ndarray | None = None
    top_logprobs: np.ndarray | None = None


# XLA:GPU's rematerialization pass budgets a program 80 % of device memory (times
# xla_gpu_memory_limit_slop_factor, 95 %) and counts its parameters. The KV pool is sized to
# fill memory, so weights + pool exceed that budget by design: the pass cannot free anything
# (parameters are not rematerializable) yet clones kernels trying ("_remat" fusions in the
# 8B decode profile, "Can't reduce memory use below ..." warnings) and spends compile time.
# Temporaries are budgeted by kv_sizing's activation probe instead.
COMPILER_OPTIONS = {"xla_gpu_memory_limit_slop_factor": 1000}


def _make_sampler(needs: SamplerNeeds):
    """The jitted sampler program of static ``needs``: (logits, *SamplingArrays fields,
    counts, logit_bias) -> (SampleOutput, counts, logit_bias), both tables donated."""

    def run(logits, *rest):
        *sa, counts, bias = rest
        return sample_rows(logits, SamplingArrays(*sa), counts, needs, bias)

    n = len(SamplingArrays._fields)
    return jax.jit(run, donate_argnums=(1 + n, 2 + n))


# The programs that do not depend on the model (sampler variants, penalty history, page copy,
# token gather) are jitted once per process and shared by every runner: jit caches the traced,
# lowered and compiled program of each argument shape, so a second engine (the synchronous
# twin of an async one, a benchmark's next configuration, the test suite's many engines) takes
# them from memory instead of tracing and compiling them again. Their shapes carry everything
# they depend on (S, V, num_slots, the pool's); ``jax.clear_caches()`` drops them, and a
# change to a module constant read while tracing (the sampling_* modules' tunables) needs it.
_SHARED_SAMPLERS = {name: _make_sampler(needs) for name, needs in SAMPLER_VARIANTS.items()}
_SHARED = {HISTORY: jax.jit(load_token_history, donate_argnums=(0,)),
           COPY: jax.jit(copy_pages, donate_argnums=(0,)), GATHER: jax.jit(_gather_tokens),
           BIAS: jax.jit(load_logit_bias, donate_argnums=(0,)),
           MASK: jax.jit(load_allowed_masks, donate_argnums=(0,))}


def _metadata(inputs: StepInputs) -> AttentionMetadata:
    return AttentionMetadata(inputs.positions, inputs.slot_mapping, inputs.seq_ids,
                             inputs.block_tables, inputs.seq_lens, inputs.logits_indices,
                             is_prefill=inputs.bucket.kind == "prefill")


class ModelRunner(SlotStateLoaders):
    """Runs padded steps of ``model`` against a paged KV pool of ``num_pages`` pages.

    Args:
      model: the network (its weights move into the runner's state).
      num_pages: pages in the pool including the null page 0.
      page_size: tokens per page.
      attention: the attention backend used inside the compiled programs.
      kv_dtype: dtype of the KV pool (the model dtype, or float8_e4m3fn for an FP8 pool).
      kv_scales: (k_scale, v_scale), each [L] float32, for an FP8 pool (default 1.0; see
        layers/attention.py); None otherwise.
      abstract: the model holds ShapeDtypeStructs (built under ``nnx.eval_shape``) and the
        pool is not allocated: the runner lowers and compiles programs but cannot run them.
      num_slots: penalty-state slots (the engine's ``max_num_seqs``); the programs' shapes
        depend on it, so ahead-of-time compilation must pass the engine's value.
    Raises:
      ValueError: ``kv_scales`` for a pool that is not FP8, or not [L] positive numbers.
    """

    def __init__(self, model: CausalLM, *, num_pages: int, page_size: int,
                 attention: AttentionBackend, kv_dtype: Any, abstract: bool = False,
                 num_slots: int = 0, kv_scales: tuple[Any, Any] | None = None):
        cfg = model.cfg
        self.model_config = cfg
        self.graphdef, self.state = nnx.split(model)
        # The programs take the weights as a flat list: a compiled call flattens its
        # arguments every step, and an nnx.State goes through Python flatten callbacks
        # node by node (8B FP8, 323 arrays, an H200 host: a compiled no-op call 422 us with
        # the State, 156 us with the list; benchmarks/decode_launch.py, record
        # benchmarks/results/decode_launch_h200_s11-20261202.json).
        self.weights, self.weights_tree = jax.tree.flatten(self.state)
        self.attention = attention
        self.page_size = page_size
        self.num_pages = num_pages
        def pool() -> Any:
            return allocate_kv_cache(cfg.num_layers, cfg.num_kv_heads, num_pages, page_size,
                                     cfg.head_dim, kv_dtype, kv_scales,
                                     per_layer=not model.scan_layers)  # see KVCache

        self.cache = jax.eval_shape(pool) if abstract else pool()
        self.num_slots = num_slots
        counts_shape = (num_slots + 1, cfg.vocab_size)  # + the scratch row
        self.counts = (jax.ShapeDtypeStruct(counts_shape, jnp.int32) if abstract
                       else jnp.zeros(counts_shape, jnp.int32))
        self.logit_bias = LogitBias.zeros(num_slots + 1, abstract)
        self.num_compilations = 0  # programs compiled by XLA
        self.num_loaded = 0  # programs loaded from program_store or JAX's persistent cache
        self.program_store: Any = None  # a compile_cache.ProgramStore, set by the engine
        self.compile_seconds: dict[tuple[str, Bucket], float] = {}
        self._executables: dict[tuple[str, Bucket], Any] = {}
        self._build_locks = KeyLocks()  # executable(): one build per program across threads
        self._count_lock = threading.Lock()  # num_compilations / num_loaded
        self._samplers: dict[tuple[int, str], Any] = {}  # (S, variant) -> program, per step
        # The model programs close over this model's graph and attention backend: per runner.
        self._jitted = {SAMPLE: self._make_step(SAMPLE), LOGITS: self._make_step(LOGITS),
                        **_SHARED}
        self._jitted_samplers = _SHARED_SAMPLERS

    # ----------------------------------------------------------------- programs
    def _make_step(self, mode: str):
        graphdef, attention, tree = self.graphdef, self.attention, self.weights_tree

        # Arguments: (weights, cache, token_ids, md), weights the flat list ``self.weights``.
        # Returns (logits, cache): SAMPLE [S, V] float32, the rows of md.logits_indices;
        # LOGITS [T, V] float32, every token's.
        def step(weights, cache, token_ids, md):
            model = nnx.merge(graphdef, jax.tree.unflatten(tree, weights))
            hidden, cache = model(token_ids, cache, md, attention)
            if mode == SAMPLE:
                hidden = hidden[md.logits_indices]
            return model.logits(hidden), cache

        return jax.jit(step, donate_argnums=(1,))

    def abstract_args(self, bucket: Bucket) -> tuple:
        """The program arguments of ``bucket`` as ``jax.ShapeDtypeStruct`` trees, for
        ``jax.jit(...).lower`` without data (``jaxinfer compile``, runner_multi, benchmarks).

        A model bucket (prefill / decode) gives ``(weights, cache, token_ids [T] int32, md)``:
        the flat weight list (``self.weights``, unflattened by ``self.weights_tree``), the KV
        pool tree and an ``AttentionMetadata`` of positions / slot_mapping / seq_ids [T],
        block_tables [S, P], seq_lens / logits_indices [S] (all int32). A sampler bucket
        gives ``(logits [S, V] float32, *SamplingArrays, counts, logit_bias)``; the history,
        bias, gather and page-copy buckets give their programs' arguments (comments below).
        """
        T, S, P = bucket.num_tokens, bucket.num_seqs, bucket.max_pages
        i32, f32 = jnp.int32, jnp.float32
        sds = jax.ShapeDtypeStruct
        counts = sds(self.counts.shape, self.counts.dtype)
        bias = jax.tree.map(lambda a: sds(a.shape, a.dtype), self.logit_bias)
        if bucket.kind in SAMPLER_VARIANTS:  # sampler(logits [S, V], *SamplingArrays, counts,
            #                                          logit_bias)
            sp = (sds(a.shape, a.dtype) for a in SamplingArrays.neutral(S))
            return (sds((S, self.model_config.vocab_size), f32), *sp, counts, bias)
        if bucket.kind == BIAS:  # load_logit_bias(logit_bias, slot, ids [K], values [K],
            #                                        bad_ids [W, L], recent [L - 1])
            return (bias, sds((), i32), sds((T,), i32), sds((T,), f32),
                    *(sds(a.shape[1:], a.dtype) for a in bias[2:]))
        if bucket.kind == HISTORY:  # load_token_history(counts, slot, token_ids, num_prompt,
            #                                            ids, keep, flag)
            return (counts, sds((), i32), sds((T,), i32), sds((), i32),
                    sds((STOP_IDS_PER_CALL,), i32), sds((), jnp.bool_), sds((), i32))
        if bucket.kind == MASK:  # load_allowed_masks(counts, slots [R], masks [R, W])
            return (counts, sds((S,), i32), sds((S, (counts.shape[1] + 31) // 32), i32))
        if bucket.kind == GATHER:  # _gather_tokens(tokens [S], rows [S])
            return (sds((S,), i32), sds((S,), i32))
        if bucket.kind == "kv":  # copy_pages(cache, src [C], dst [C], count)
            cache = jax.tree.map(lambda a: sds(a.shape, a.dtype), self.cache)
            return (cache, sds((T,), i32), sds((T,), i32), sds((), i32))
        md = AttentionMetadata(positions=sds((T,), i32), slot_mapping=sds((T,), i32),
                               seq_ids=sds((T,), i32), block_tables=sds((S, P), i32),
                               seq_lens=sds((S,), i32), logits_indices=sds((S,), i32),
                               is_prefill=bucket.kind == "prefill")
        weights = [sds(a.shape, a.dtype) for a in self.weights]
        cache = jax.tree.map(lambda a: sds(a.shape, a.dtype), self.cache)
        return (weights, cache, sds((T,), i32), md)

    def lower(self, bucket: Bucket, mode: str = SAMPLE) -> jax.stages.Lowered:
        """Trace and lower the program of ``bucket`` from abstract shapes (mode SAMPLER:
        ``bucket`` is a ``sampling.sampler_bucket``). Raises KeyError for an unknown mode
        or sampler variant."""
        if mode == SAMPLER:
            return self._jitted_samplers[bucket.kind].lower(*self.abstract_args(bucket))
        return self._jitted[mode].lower(*self.abstract_args(bucket))

    def executable(self, bucket: Bucket, mode: str = SAMPLE):
        """The program for ``bucket``: loaded from ``program_store`` if it has it, else
        compiled now (once; later calls return the same program). The first call for a
        SAMPLE bucket of S rows also builds every sampler variant of S (``sampler``).
        Thread-safe: threads asking for one program at once build it once (the others wait
        for it), different programs compile in parallel (XLA releases the GIL)."""
        exe = self._executables.get((mode, bucket))  # every step: no lock, no closure
        return exe if exe is not None else self._build_locks.get_or_build(
            self._executables, (mode, bucket), lambda: self._build(bucket, mode))

    def has_sample_program(self, bucket: Bucket) -> bool:
        """Whether a sample step of ``bucket`` builds nothing (its model program is built,
        and with it every sampler variant of its row count)."""
        return (SAMPLE, bucket) in self._executables

    def _build(self, bucket: Bucket, mode: str):
        # jaxinfer compile builds neither the history, copy, gather, bias nor mask program
        # without --modes sample (nor those added since a store was built): load them
        # only if present.
        exe = self.load_or_compile(mode, bucket, lambda: self.lower(bucket, mode),
                                   stored=mode not in (HISTORY, COPY, GATHER, BIAS, MASK),
                                   what=f"{mode} {bucket}")
        if mode == SAMPLE:
            for name in SAMPLER_VARIANTS:
                self.executable(sampler_bucket(bucket.num_seqs, name), SAMPLER)
        return exe

    def load_or_compile(self, mode: str, bucket: Bucket,
                        lower: Callable[[], jax.stages.Lowered], stored: bool,
                        what: str) -> Any:
        """Program ``(mode, bucket)`` from ``program_store`` (asked for it when ``stored``,
        i.e. every store holds such programs, else only if it has it), else ``lower()``
        compiled now; counted in ``num_compilations`` / ``num_loaded`` (the calling thread's
        compiles only, under a lock: threads build programs at once), timed in
        ``compile_seconds`` and logged as ``what``."""
        t0, store, exe = time.perf_counter(), self.program_store, None
        if store is not None and (stored or (mode, bucket) in store.entries):
            exe = store.load(mode, bucket)
        compiled = 0
        if exe is None:
            before = xla_compilations(this_thread=True)
            exe = lower().compile(compiler_options=COMPILER_OPTIONS)
            compiled = xla_compilations(this_thread=True) - before
        with self._count_lock:
            self.num_compilations += compiled
            self.num_loaded += compiled == 0  # program store or JAX's persistent cache
        self.compile_seconds[mode, bucket] = time.perf_counter() - t0
        log.info("%s %s in %.2f s", "compiled" if compiled else "loaded", what,
                 self.compile_seconds[mode, bucket])
        return exe

    def sampler(self, num_seqs: int, variant: str):
        """The sampler program of ``variant`` (a key of ``sampling.SAMPLER_VARIANTS``) for
        ``num_seqs`` rows, built as ``executable`` builds programs. Called as
        ``exe(logits [S, V] float32, *SamplingArrays fields, counts, logit_bias)`` (counts
        and logit_bias donated); it returns (SampleOutput, counts, logit_bias). Raises
        KeyError for an unknown variant."""
        exe = self._samplers.get((num_seqs, variant))
        if exe is None:
            exe = self._samplers[num_seqs, variant] = self.executable(
                sampler_bucket(num_seqs, variant), SAMPLER)
        return exe

    @property
    def copy_bucket(self) -> Bucket:
        """Bucket of the page-copy program: Bucket("kv", C, 1, 0), C = max(1, num_slots) page
        copies per call (one step forks at most max_num_seqs samples)."""
        return Bucket("kv", max(1, self.num_slots), 1, 0)

    @property
    def compiled_buckets(self) -> list[tuple[str, Bucket]]:
        return list(self._executables)

    # ----------------------------------------------------------------- running
    def launch(self, inputs: StepInputs, token_ids: Any = None,
               before_sample: Callable[[], None] | None = None) -> SampleOutput:
        """Dispatch one padded sample step (the model program, then the sampler program) and
        return its SampleOutput on the device, not waited for (``fetch`` reads it back).

        Args:
          inputs: the step's host arrays; ``inputs.token_ids`` is ignored when ``token_ids``
            is given.
          token_ids: [S] int32 device array of the step's input tokens (``gather_tokens``).
          before_sample: host work run after the model program is dispatched and before the
            sampler's (so it overlaps the model's device time): structured outputs' masks,
            loaded into the penalty state the sampler reads.
        """
        exe = self.executable(inputs.bucket, SAMPLE)
        # The host arrays go to the programs as they are: the compiled call transfers its
        # numpy arguments itself, ~0.6 ms a step cheaper than a jax.device_put of the 18
        # arrays first (CPU, batch 256). ``inputs`` must not change while the step runs.
        toks = inputs.token_ids if token_ids is None else token_ids
        logits, self.cache = exe(self.weights, self.cache, toks, _metadata(inputs))
        if before_sample is not None:
            before_sample()
        return self.sample(logits, inputs.sampling)

    @staticmethod
    def fetch(out: SampleOutput, want_logprobs: bool) -> SampleResult:
        """Host copy of a launched step's output (waits for it); logprobs only if asked."""
        if not want_logprobs:
            return SampleResult(np.asarray(out.tokens))
        return SampleResult(*jax.device_get(tuple(out)))

    def gather_tokens(self, tokens: Any, rows: np.ndarray) -> Any:
        """``tokens[rows]`` on the device: a decode step's input tokens taken from the
        previous step's sampled ``tokens`` ([S] int32, device) by row, ``rows`` [S] int32 in
        [0, S) (padding rows any valid index). The compiled program of ``gather_bucket(S)``;
        dispatched, not waited for."""
        exe = self.executable(gather_bucket(int(rows.shape[0])), GATHER)
        return exe(tokens, np.asarray(rows, np.int32))

    def execute(self, inputs: StepInputs, mode: str = SAMPLE,
                before_sample: Callable[[], None] | None = None) -> Any:
        """Run one padded step: mode "sample" runs the model program of ``inputs.bucket``,
        then the sampler program of ``sampling.sampler_variant(inputs.sampling, V)`` on its
        logits (on the device, dispatched back to back).

        Returns:
          mode "sample": a :class:`SampleResult` (tokens [S] int32, padding rows garbage;
            logprobs only when some row asked for them);
          mode "logits": [T, V] float32 logits of every token (numpy).
        """
        if mode == SAMPLE:
            return self.fetch(self.launch(inputs, before_sample=before_sample),
                              bool(inputs.sampling.want_logprobs.any()))
        exe = self.executable(inputs.bucket, mode)
        logits, self.cache = exe(self.weights, self.cache, inputs.token_ids, _metadata(inputs))
        return np.asarray(logits)

    def sample(self, logits: Any, sa: SamplingArrays, variant: str | None = None
               ) -> SampleOutput:
        """Sample [S, V] float32 ``logits`` (a model program's, on the device) with the
        sampler program of ``variant`` for S rows, updating the penalty state ``counts``.

        Args:
          sa: the rows' parameters, each [S] ([S, 2] seeds); numpy unless ``variant`` given.
          variant: a key of ``sampling.SAMPLER_VARIANTS`` covering the rows' needs; None:
            ``sampling.sampler_variant(sa, V)``, the cheapest that does.
        Returns:
          the SampleOutput, on the device (dispatched, not waited for).
        """
        if variant is None:
            variant = sampler_variant(sa, self.model_config.vocab_size)
        out, self.counts, self.logit_bias = self.sampler(len(sa.temperature), variant)(
            logits, *sa, self.counts, self.logit_bias)
        return out

    def copy_pages(self, copies: Any) -> None:
        """Copy-on-write: copy KV page ``c.src`` into page ``c.dst`` for every
        ``block_manager.PageCopy`` ``c`` (all layers and KV heads), before the next step.

        Runs the compiled copy program in chunks of ``copy_bucket.num_tokens`` copies (fixed
        shapes: never recompiles). Raises ValueError for a page id outside the pool.
        """
        C = self.copy_bucket.num_tokens
        exe = self.executable(self.copy_bucket, COPY)
        copies = list(copies)
        for c in copies:
            if not (0 < c.src < self.num_pages and 0 < c.dst < self.num_pages):
                raise ValueError(f"page copy {c} is outside the pool's pages "
                                 f"1..{self.num_pages - 1}")
        for start in range(0, len(copies), C):
            chunk = copies[start:start + C]
            src, dst = np.zeros(C, np.int32), np.zeros(C, np.int32)
            src[:len(chunk)] = [c.src for c in chunk]
            dst[:len(chunk)] = [c.dst for c in chunk]
            self.cache = exe(self.cache, src, dst, np.int32(len(chunk)))

    def kv_cache_bytes(self) -> int:
        """Device bytes of the KV pool: pages, plus the scales of an FP8 pool."""
        return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(self.cache))

