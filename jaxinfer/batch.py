"""Turn a scheduler decision into padded numpy arrays of a compiled bucket (no JAX here).

A *bucket* is the static shape of one compiled program: ``(kind, T, S, maxp)`` with T the
token count, S the sequence rows and maxp the block-table width in pages. Rows and tokens
past the real ones are padding: their tokens write into the null page 0, their block-table
entries are 0, and their ``seq_lens`` are 0 so attention ignores them.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Protocol, Sequence as Seq

import numpy as np

# Sampling seeds are split into two uint32 words; a request without a seed gets one drawn
# from the engine's generator so that unseeded requests differ from each other.
_U32 = np.uint32


class BucketError(ValueError):
    """The step does not fit any compiled bucket (a scheduler/config mismatch)."""


@dataclass(frozen=True)
class Bucket:
    kind: str  # "prefill" | "decode"
    num_tokens: int
    num_seqs: int
    max_pages: int

    def __str__(self) -> str:
        return f"{self.kind}(T={self.num_tokens}, S={self.num_seqs}, pages={self.max_pages})"


def pick(buckets: Seq[int], n: int, what: str) -> int:
    """Smallest bucket >= n; raises BucketError when none holds n."""
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise BucketError(f"{what} {n} exceeds the largest bucket {buckets[-1]}")
    return buckets[i]


class _Chunk(Protocol):  # what batch building needs of a scheduled chunk
    start: int
    num_tokens: int

    @property
    def seq(self): ...


@dataclass
class StepInputs:
    """Host arrays of one step, already padded to ``bucket`` (see AttentionMetadata)."""

    bucket: Bucket
    token_ids: np.ndarray       # [T] int32
    positions: np.ndarray       # [T] int32
    slot_mapping: np.ndarray    # [T] int32
    seq_ids: np.ndarray         # [T] int32, -1 padding
    block_tables: np.ndarray    # [S, maxp] int32
    seq_lens: np.ndarray        # [S] int32
    logits_indices: np.ndarray  # [S] int32
    temperature: np.ndarray     # [S] float32 (0 = greedy)
    top_k: np.ndarray           # [S] int32 (0 = off)
    top_p: np.ndarray           # [S] float32
    seeds: np.ndarray           # [S, 2] uint32
    sample_index: np.ndarray    # [S] int32 index of the token being sampled (per request)


def build_step(chunks: Seq[_Chunk], *, is_prefill: bool, page_size: int,
               token_buckets: Seq[int], seq_buckets: Seq[int], page_buckets: Seq[int],
               request_seeds: dict[int, int]) -> StepInputs:
    """Pack ``chunks`` (each: tokens [start, start+num_tokens) of one sequence) into a bucket.

    Args:
      chunks: scheduled chunks; decode chunks have num_tokens == 1.
      token_buckets / seq_buckets / page_buckets: the compiled sizes to choose from (for decode
        the token bucket equals the sequence bucket).
      request_seeds: seq_id -> seed used for sampling (the engine fills it per request).
    Raises:
      BucketError: if the step exceeds every bucket.
    """
    if not chunks:
        raise BucketError("cannot build a step with no sequences")
    n_tok = sum(c.num_tokens for c in chunks)
    S = pick(seq_buckets, len(chunks), "sequence count")
    T = pick(token_buckets, n_tok, "token count") if is_prefill else S
    need_pages = max(-(-(c.start + c.num_tokens) // page_size) for c in chunks)
    P = pick(page_buckets, need_pages, "pages per sequence")
    bucket = Bucket("prefill" if is_prefill else "decode", T, S, P)

    token_ids = np.zeros(T, np.int32)
    positions = np.zeros(T, np.int32)
    slot_mapping = np.zeros(T, np.int32)  # padding -> null page 0
    seq_ids = np.full(T, -1, np.int32)
    block_tables = np.zeros((S, P), np.int32)
    seq_lens = np.zeros(S, np.int32)
    logits_indices = np.zeros(S, np.int32)
    temperature = np.zeros(S, np.float32)
    top_k = np.zeros(S, np.int32)
    top_p = np.ones(S, np.float32)
    seeds = np.zeros((S, 2), _U32)
    sample_index = np.zeros(S, np.int32)

    t = 0
    for row, c in enumerate(chunks):
        seq = c.seq
        end = c.start + c.num_tokens
        table = np.asarray(seq.block_table[:-(-end // page_size)], np.int32)
        block_tables[row, :len(table)] = table
        pos = np.arange(c.start, end, dtype=np.int32)
        token_ids[t:t + c.num_tokens] = np.asarray(seq.all_token_ids[c.start:end], np.int32)
        positions[t:t + c.num_tokens] = pos
        slot_mapping[t:t + c.num_tokens] = table[pos // page_size] * page_size + pos % page_size
        seq_ids[t:t + c.num_tokens] = row
        seq_lens[row] = end
        logits_indices[row] = t + c.num_tokens - 1
        sp = seq.sampling_params
        temperature[row] = sp.temperature
        top_k[row] = max(sp.top_k, 0)
        top_p[row] = sp.top_p
        seed = request_seeds.get(seq.seq_id, 0)
        seeds[row] = (seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF)
        sample_index[row] = end - seq.num_prompt_tokens
        t += c.num_tokens
    return StepInputs(bucket, token_ids, positions, slot_mapping, seq_ids, block_tables,
                      seq_lens, logits_indices, temperature, top_k, top_p, seeds, sample_index)
