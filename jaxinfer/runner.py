"""The model runner: compiled step programs keyed by bucket, the device KV pool, sampling.

Each bucket (see ``batch.Bucket``) is lowered and compiled once, ahead of time, with the KV
pool donated so page writes happen in place. ``num_compilations`` counts compilations so
tests can assert that serving compiles nothing after warm-up.
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
    """

    def __init__(self, model: CausalLM, *, num_pages: int, page_size: int,
                 attention: AttentionBackend, kv_dtype: Any):
        cfg = model.cfg
        self.model_config = cfg
        self.graphdef, self.state = nnx.split(model)
        self.attention = attention
        self.page_size = page_size
        self.num_pages = num_pages
        self.cache = allocate_kv_cache(cfg.num_layers, cfg.num_kv_heads, num_pages, page_size,
                                       cfg.head_dim, kv_dtype)
        self.num_compilations = 0
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

    def executable(self, bucket: Bucket, mode: str = SAMPLE):
        """The compiled program for ``bucket`` (compiled now if it is new)."""
        key = (mode, bucket)
        exe = self._executables.get(key)
        if exe is None:
            t0 = time.perf_counter()
            exe = self._jitted[mode].lower(*self._abstract_args(bucket)).compile()
            self.compile_seconds[key] = time.perf_counter() - t0
            self.num_compilations += 1
            log.info("compiled %s %s in %.2f s", mode, bucket, self.compile_seconds[key])
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

