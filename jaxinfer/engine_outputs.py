"""What a step's sampled tokens do to its requests (split from jaxinfer/engine.py, as
engine_logits.py and engine_multi.py are): :func:`record_step` appends each row's token under
the stop rules (``Scheduler.postprocess``, then stop strings) with its logprobs (and the
tokens structured-output grammars force: :func:`append_forced`), and
:func:`request_output` builds a request's ``RequestOutput`` (vLLM's, every sample's
``CompletionOutput``). Both take the ``LLMEngine`` whose state they read and update.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from jaxinfer import engine_logits, jump_forward
from jaxinfer.outputs import Logprobs, RequestOutput, logprobs_entry
from jaxinfer.request_checks import masked_stops

if TYPE_CHECKING:
    from jaxinfer.engine import LLMEngine
    from jaxinfer.runner import SampleResult
    from jaxinfer.scheduler import SchedulerOutput
    from jaxinfer.sequence import Sequence


def record_step(engine: LLMEngine, out: SchedulerOutput, res: SampleResult,
                touched: dict[int, Sequence]) -> list[Sequence]:
    """Append step ``out``'s tokens (``Scheduler.postprocess``, stop strings, logprobs);
    adds the requests that advanced to ``touched``; returns the sequences it finished."""
    for c in out.chunks:  # before postprocess: a request may finish and free its pages
        seq = c.seq
        if (seq.sampling_params.prompt_logprobs is not None and c.samples
                and not seq.output_token_ids):
            st = engine._states.get(seq.seq_id)
            if st is not None and st.prompt_logprobs is None:  # vLLM's prompt_logprobs
                st.prompt_logprobs = engine_logits.prompt_logprobs(engine, seq)
    row = ({c.seq.key: i for i, c in enumerate(out.chunks)} if res.logprobs is not None
           else {})  # logprobs rows: only when some row asked for them
    new_tokens, finished = engine.scheduler.postprocess(
        out, res.tokens[:len(out.chunks)].tolist())
    now = time.monotonic()
    states, first_token_time = engine._states, engine._first_token_time
    jumpers: list[tuple[Sequence, Any]] = []  # rows that may take forced tokens
    for seq, tok in new_tokens:
        rid = seq.seq_id
        touched[rid] = seq
        if rid not in first_token_time:
            first_token_time[rid] = now
        st = states[rid].samples[seq.sample_index]
        lp: Logprobs | None = None
        k = seq.sampling_params.logprobs
        if k is not None and res.logprobs is not None:
            r = row[seq.key]
            lp = logprobs_entry(tok, res.logprobs[r], res.top_ids[r], res.top_logprobs[r], k)
        if text_and_grammar_rules(engine, seq, st, tok, lp):
            finished.append(seq)
        elif (engine.config.jump_forward and not seq.is_finished
              and seq.sampling_params.structured_outputs is not None):
            jumpers.append((seq, st))
    if jumpers:  # tokens the rows' grammars force, appended unsampled (jump_forward.py)
        for seq, st, forced in jump_forward.plan(engine, jumpers):
            append_forced(engine, seq, st, forced, finished)
    return finished


def text_and_grammar_rules(engine: LLMEngine, seq: Sequence, st: Any, tok: int,
                           lp: Logprobs | None) -> bool:
    """The rules after the scheduler's for ``tok``, just appended to ``seq``'s outputs (its
    stream state ``st``, logprobs entry ``lp``): stop strings ("stop" over "length"), then
    the structured-outputs grammar ("stop" at its end, "abort" for a token it refuses).
    Returns True when they finished ``seq`` (it was running)."""
    stop_token = seq.is_finished and seq.finish_reason == "stop"  # EOS, a stop id
    if st.add_token(tok, lp, stop_token):  # a stop string
        if seq.is_finished:
            seq.finish_reason = "stop"
            return False
        engine.scheduler.finish_sample(seq, "stop")
        return True
    if seq.sampling_params.structured_outputs is not None and not seq.is_finished:
        ended = engine.structured.accept(seq, tok)  # "stop": the grammar is complete
        if ended is not None:
            engine.scheduler.finish_sample(seq, "stop" if ended == "stop" else "abort")
            return True
    return False


def append_forced(engine: LLMEngine, seq: Sequence, st: Any, forced: list[int],
                  finished: list[Sequence]) -> None:
    """Append the tokens ``seq``'s grammar forces (jump-forward decoding, the rows
    ``jump_forward.plan`` picks), each under the rules of a sampled token: the
    ``min_tokens`` mask (a stop token it would mask ends the jump before it: the row
    samples there under the mask, as without jumps), the scheduler's stop rules
    (``Scheduler.append_token``), then :func:`text_and_grammar_rules`. Counts them in
    ``engine.num_jump_forward_tokens``; adds ``seq`` to ``finished`` if they finish it."""
    sp = seq.sampling_params
    masked = masked_stops(sp, engine.model_config.vocab_size, engine.scheduler.cfg.eos_token_ids)
    for tok in forced:
        if tok in masked and seq.num_output_tokens < sp.min_tokens:
            return
        engine.num_jump_forward_tokens += 1
        ended = engine.scheduler.append_token(seq, tok)
        if text_and_grammar_rules(engine, seq, st, tok, None) or ended:
            finished.append(seq)
            return


def request_output(engine: LLMEngine, seq: Sequence) -> RequestOutput:
    """The RequestOutput of ``seq``'s request: every sample's CompletionOutput."""
    rid, group = seq.seq_id, seq.group
    st = engine._states[rid]
    metrics = {"arrival_time": seq.arrival_time,  # prefix-cache hit of sample 0
               "num_cached_tokens": group.samples[0].num_cached_tokens}
    first = engine._first_token_time.get(rid)
    if first is not None:
        metrics["first_token_time"] = first
    return RequestOutput(
        request_id=rid, prompt=engine._prompts.get(rid),
        prompt_token_ids=st.prompt_token_ids, outputs=st.completions(group.samples),
        finished=group.is_finished, metrics=metrics, prompt_logprobs=st.prompt_logprobs)
