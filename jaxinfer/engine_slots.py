"""The device state a scheduled step needs before it runs (split from jaxinfer/engine.py, as
engine_outputs.py is): :func:`prepare_device` runs the step's copy-on-write page copies,
gives every sequence of the step a penalty-state slot and loads what a (re)admitted
sequence's sampling parameters keep there, and loads the structured-outputs rows' masks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from jaxinfer.request_checks import masked_stops

if TYPE_CHECKING:
    from jaxinfer.engine import LLMEngine
    from jaxinfer.scheduler import SchedulerOutput


def prepare_device(engine: LLMEngine, out: SchedulerOutput) -> None:
    """Device state the step needs: the copy-on-write page copies of samples forked for
    it; a penalty-state slot for every sequence of the step (preempted ones lose theirs),
    loaded from its tokens, stop tokens and allowed tokens for a newly (re)admitted
    sequence with penalties, ``min_tokens`` (its stop tokens are masked until then) or
    ``allowed_token_ids`` (the others are masked); its ``logit_bias`` and
    ``bad_words`` tables (matching from the outputs it has). Returns the loader of the
    masks of the step's rows with ``structured_outputs`` (:func:`structured_masks`), for
    ``ModelRunner.launch(before_sample=...)``, or None when it has none."""
    if out.page_copies:
        engine.runner.copy_pages(out.page_copies)
    for seq in out.preempted:
        engine._slots.release(seq.key)
    held = engine._slots.mapping
    for c in out.chunks:
        seq = c.seq
        if seq.key in held:
            continue
        slot = engine._slots.assign(seq.key)
        sp = seq.sampling_params
        if sp.has_penalties or sp.min_tokens > 0 or sp.allowed_token_ids:
            ids = seq.all_token_ids  # prompt + outputs kept across preemption
            toks = np.full(engine.config.max_model_len, -1, np.int32)
            toks[:len(ids)] = ids
            stops = masked_stops(sp, engine.model_config.vocab_size,
                                 engine.scheduler.cfg.eos_token_ids)
            engine.runner.load_history(slot, toks, seq.num_prompt_tokens, sorted(stops),
                                       sorted(set(sp.allowed_token_ids or ())))
        if sp.logit_bias or sp.bad_words:
            engine.runner.load_logit_bias(slot, sp.logit_bias,
                                          sp.bad_words_token_ids or (), seq.output_token_ids)
    return structured_masks(engine, out)


def structured_masks(engine: LLMEngine, out: SchedulerOutput) -> Callable[[], None] | None:
    """For step ``out``'s rows with ``structured_outputs`` that sample: a function that
    computes the tokens each row's grammar allows next (``GrammarMatchers.masks``, host) and
    loads them into the rows' slots (``load_allowed_masks``); None when the step has none.
    The runner calls it after dispatching the model program, so the host's masks overlap
    the device's forward pass."""
    if not engine.structured.active:  # the common step: no scan of its rows
        return None
    rows = [c.seq for c in out.chunks
            if c.samples and c.seq.sampling_params.structured_outputs is not None]
    if not rows:
        return None
    slots = [engine._slots.mapping[q.key] for q in rows]

    def load() -> None:
        engine.runner.load_allowed_masks(slots, engine.structured.masks(rows),
                                         engine.config.decode_buckets)

    return load
