"""Scoring a prompt through the paged engine path: ``LLMEngine.prompt_logits`` and
``LLMEngine.prompt_kv`` (research) and vLLM's ``prompt_logprobs`` of a request, all through
the compiled "logits" programs (jaxinfer/runner.py ``LOGITS``) over a sequence's own block
table."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any
from typing import Sequence as Seq

import numpy as np

from jaxinfer.outputs import Logprobs, prompt_logprobs_from_logits
from jaxinfer.runner import LOGITS
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.sequence import Sequence


def prompt_logprobs(engine: Any, seq: Sequence) -> list[Logprobs | None]:
    """vLLM's prompt_logprobs of a sequence whose prompt K/V are all in its pages.

    The prompt is scored again through the "logits" program over the sequence's own
    block table (prefix-cached pages included) with every K/V write sent to the null
    page, so no page changes; position i's entry is the log-softmax of the logits at
    i - 1 (raw, float32 on the host): the prompt token and the k best.
    """
    ids, n, k = seq.prompt_token_ids, seq.num_prompt_tokens, seq.sampling_params.prompt_logprobs
    assert k is not None  # the caller checks
    rows, step = [], engine.config.max_num_batched_tokens
    for start in range(0, n - 1, step):  # the last prompt token predicts no prompt token
        m = min(step, n - 1 - start)
        inputs = engine._inputs([_Chunk(seq, start, m)], True)
        inputs.slot_mapping[:] = 0  # read-only: write into the null page
        rows.append(engine.runner.execute(inputs, LOGITS)[:m])
    return prompt_logprobs_from_logits(np.concatenate(rows) if rows else None, ids, k)


def prompt_logits(engine: Any, prompt: str | Seq[int]) -> np.ndarray:
    """Logits [N, V] float32 of every prompt position, through the paged engine path.

    The prompt is prefilled in chunks of at most ``max_num_batched_tokens`` into pages
    borrowed from the pool and returned afterwards. Call between steps.

    Raises:
      RequestError: the prompt is longer than max_model_len (or cannot be encoded), or
        needs more KV pages than are free now (running requests hold the rest).
    """
    with _prefilled(engine, prompt, "prompt_logits") as (_, rows):
        return np.concatenate(rows)


def prompt_kv(engine: Any, prompt: str | Seq[int]) -> tuple[np.ndarray, np.ndarray]:
    """The KV cache of a prompt: ``(k, v)``, each float32 [L, N, Hkv, D] (layers, prompt
    positions, KV heads, head dim), read back from the pages the paged engine path wrote.

    Keys are as attention reads them: after the k projection's bias, Gemma 3's / Qwen3's k
    norm and RoPE at each position (as HF transformers' ``past_key_values`` hold them);
    values after the v projection. An FP8 pool's entries come back times their layer's
    scale (read = stored * scale, pallas_kernels/paged_attention/reference.py), so the
    quantization error is in them. The prompt is prefilled as for :func:`prompt_logits`
    into borrowed pages, read, and the pages returned. Call between steps.

    Raises:
      RequestError: as :func:`prompt_logits`.
    """
    with _prefilled(engine, prompt, "prompt_kv") as (seq, _):
        cache, ps = engine.runner.cache, engine.config.block_size
        n = seq.num_prompt_tokens
        pages = np.asarray(seq.block_table[:-(-n // ps)], np.int32)
        out = []
        for pool, scales in ((cache.k, cache.k_scale), (cache.v, cache.v_scale)):
            layers = []
            for layer in range(engine.model_config.num_layers):
                arr = pool[layer][0] if cache.per_layer else pool[layer]  # [Hkv, P, ps, D]
                x = np.asarray(arr[:, pages].astype(np.float32))  # [Hkv, pages, ps, D]
                x = x.reshape(x.shape[0], -1, x.shape[-1])[:, :n].transpose(1, 0, 2)
                if scales is not None:
                    x = x * np.float32(np.asarray(scales[layer]).reshape(()))
                layers.append(x)
            out.append(np.stack(layers))
        return out[0], out[1]


@contextlib.contextmanager
def _prefilled(engine: Any, prompt: str | Seq[int], what: str,
               run: Callable[[Any, int], Any] | None = None
               ) -> Iterator[tuple[Sequence, list[Any]]]:
    """Prefill ``prompt`` into pages borrowed from the pool, in chunks of at most
    ``max_num_batched_tokens``; yields ``(sequence, [run(inputs, n) of each chunk])`` while
    the pages hold its K/V and frees them on exit. ``run`` executes a chunk's padded
    StepInputs whose first n tokens are real (default: the "logits" program, its [n, V]
    logits). Raises RequestError (``what`` names the caller) as :func:`prompt_logits`
    says."""
    from jaxinfer.engine import PromptTooLongError, RequestError

    ids = engine.encode_prompt(prompt)
    if len(ids) > engine.config.max_model_len:
        raise PromptTooLongError(f"prompt has {len(ids)} tokens; max_model_len is "
                                 f"{engine.config.max_model_len}")
    seq = Sequence(-1, ids, SamplingParams(temperature=0.0, max_tokens=1))
    bm = engine.scheduler.block_manager
    need = bm.pages_needed(seq, len(ids))
    if need > bm.num_usable_pages:
        raise RequestError(
            f"{what}: the prompt ({len(ids)} tokens) needs {need} KV pages; the pool has "
            f"{bm.num_usable_pages} in all (num_kv_pages): give the engine more KV pages or "
            f"pass a shorter prompt")
    if not bm.can_allocate(seq, len(ids)):
        raise RequestError(
            f"{what}: the prompt ({len(ids)} tokens) needs "
            f"{need} KV pages but {bm.num_free_pages} of the pool's "
            f"{bm.num_usable_pages} are free (running requests hold the rest): call it when "
            f"fewer requests run, or give the engine more KV pages")
    bm.allocate(seq, len(ids))
    try:
        rows, step = [], engine.config.max_num_batched_tokens
        for start in range(0, len(ids), step):
            n = min(step, len(ids) - start)
            inputs = engine._inputs([_Chunk(seq, start, n)], True)
            rows.append(run(inputs, n) if run is not None else
                        engine.runner.execute(inputs, LOGITS)[:n])
        yield seq, rows
    finally:
        bm.free(seq)


class _Chunk:
    """A scheduled chunk built outside the scheduler (research paths)."""

    def __init__(self, seq: Sequence, start: int, num_tokens: int):
        self.seq, self.start, self.num_tokens = seq, start, num_tokens
