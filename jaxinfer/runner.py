"""The model runner: compiled step programs keyed by bucket, the device KV pool, sampling.

Each bucket (see ``batch.Bucket``) is lowered and compiled once, ahead of time, with the KV
pool donated so page writes happen in place. ``num_compilations`` counts programs compiled by
XLA so tests can assert that serving compiles nothing after warm-up; ``num_loaded`` counts
programs loaded instead (from a ``jaxinfer compile`` cache set as ``program_store``, or from
JAX's persistent compilation cache).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxinfer.batch import Bucket, StepInputs
from jaxinfer.compile_cache import xla_compilations
from jaxinfer.layers.attention import AttentionBackend, AttentionMetadata, allocate_kv_cache
from jaxinfer.models.transformer import CausalLM
from jaxinfer.sampling import sample

log = logging.getLogger(__name__)

# Modes of a compiled step: sample one token per row, or return every token's logits
# (research / parity checks / prompt logprobs).
SAMPLE, LOGITS = "sample", "logits"


class ModelRunner:
    """Runs padded steps of ``model`` against a paged KV pool of ``num_pages`` pages.

    Args:
      model: the network (its weights move into the runner's state).
      num_pages: pages in the pool including the null page 0.
      page_size: tokens per page.
      attention: the attention backend used inside the compiled programs.
      kv_dtype: dtype of the KV pool.
      abstract: the model holds ShapeDtypeStructs (built under ``nnx.eval_shape``) and the
        pool is not allocated: the runner lowers and compiles programs but cannot run them.
    """

    def __init__(self, model: CausalLM, *, num_pages: int, page_size: int,
                 attention: AttentionBackend, kv_dtype: Any, abstract: bool = False):
        cfg = model.cfg
        self.model_config = cfg
        self.graphdef, self.state = nnx.split(model)
        self.attention = attention
        self.page_size = page_size
        self.num_pages = num_pages
        def pool() -> Any:
            return allocate_kv_cache(cfg.num_layers, cfg.num_kv_heads, num_pages, page_size,
                                     cfg.head_dim, kv_dtype)

        self.cache = jax.eval_shape(pool) if abstract else pool()
        self.num_compilations = 0  # programs compiled by XLA
        self.num_loaded = 0  # programs loaded from program_store or JAX's persistent cache
        self.program_store: Any = None  # a compile_cache.ProgramStore, set by the engine
        self.compile_seconds: dict[tuple[str, Bucket], float] = {}
        self._executables: dict[tuple[str, Bucket], Any] = {}
        self._jitted = {SAMPLE: self._make_step(SAMPLE), LOGITS: self._make_step(LOGITS)}

    # ----------------------------------------------------------------- programs
    def _make_step(self, mode: str):
        graphdef, attention = self.graphdef, self.attention

        def step(state, cache, token_ids, md, temperature, top_k, top_p, seeds, sample_index):
            model = nnx.merge(graphdef, state)
            hidden, cache = model(token_ids, cache, md, attention)
            if mode == LOGITS:
                return model.logits(hidden), cache
            logits = model.logits(hidden[md.logits_indices])
            return sample(logits, temperature, top_k, top_p, seeds, sample_index), cache

        return jax.jit(step, donate_argnums=(1,))

    def _abstract_args(self, bucket: Bucket) -> tuple:
        T, S, P = bucket.num_tokens, bucket.num_seqs, bucket.max_pages
        i32, f32 = jnp.int32, jnp.float32
        sds = jax.ShapeDtypeStruct
        md = AttentionMetadata(positions=sds((T,), i32), slot_mapping=sds((T,), i32),
                               seq_ids=sds((T,), i32), block_tables=sds((S, P), i32),
                               seq_lens=sds((S,), i32), logits_indices=sds((S,), i32),
                               is_prefill=bucket.kind == "prefill")
        state = jax.tree.map(lambda a: sds(a.shape, a.dtype), self.state)
        cache = jax.tree.map(lambda a: sds(a.shape, a.dtype), self.cache)
        return (state, cache, sds((T,), i32), md, sds((S,), f32), sds((S,), i32),
                sds((S,), f32), sds((S, 2), jnp.uint32), sds((S,), i32))

    def lower(self, bucket: Bucket, mode: str = SAMPLE) -> jax.stages.Lowered:
        """Trace and lower the program of ``bucket`` from abstract shapes."""
        return self._jitted[mode].lower(*self._abstract_args(bucket))

    def executable(self, bucket: Bucket, mode: str = SAMPLE):
        """The program for ``bucket``: loaded from ``program_store`` if it has it, else
        compiled now (once; later calls return the same program)."""
        key = (mode, bucket)
        exe = self._executables.get(key)
        if exe is None:
            t0 = time.perf_counter()
            if self.program_store is not None:
                exe = self.program_store.load(mode, bucket)
            compiled = 0
            if exe is None:
                before = xla_compilations()
                exe = self.lower(bucket, mode).compile()
                compiled = xla_compilations() - before
            self.num_compilations += compiled
            self.num_loaded += compiled == 0  # program store or JAX's persistent cache
            self.compile_seconds[key] = time.perf_counter() - t0
            log.info("%s %s %s in %.2f s", "compiled" if compiled else "loaded", mode, bucket,
                     self.compile_seconds[key])
            self._executables[key] = exe
        return exe

    @property
    def compiled_buckets(self) -> list[tuple[str, Bucket]]:
        return list(self._executables)

    # ----------------------------------------------------------------- running
    def execute(self, inputs: StepInputs, mode: str = SAMPLE) -> np.ndarray:
        """Run one padded step.

        Returns:
          mode "sample": [S] int32 sampled token per row (padding rows are garbage);
          mode "logits": [T, V] float32 logits of every token.
        """
        exe = self.executable(inputs.bucket, mode)
        host = (inputs.token_ids, inputs.positions, inputs.slot_mapping, inputs.seq_ids,
                inputs.block_tables, inputs.seq_lens, inputs.logits_indices,
                inputs.temperature, inputs.top_k, inputs.top_p, inputs.seeds,
                inputs.sample_index)
        (token_ids, positions, slot_mapping, seq_ids, block_tables, seq_lens, logits_indices,
         temperature, top_k, top_p, seeds, sample_index) = jax.device_put(host)
        md = AttentionMetadata(positions, slot_mapping, seq_ids, block_tables, seq_lens,
                               logits_indices, is_prefill=inputs.bucket.kind == "prefill")
        out, self.cache = exe(self.state, self.cache, token_ids, md, temperature, top_k,
                              top_p, seeds, sample_index)
        return np.asarray(out)

    def kv_cache_bytes(self) -> int:
        return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(self.cache))

