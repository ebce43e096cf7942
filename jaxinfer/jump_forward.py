"""Jump-forward decoding of structured outputs (``EngineConfig.jump_forward``; SGLang's, Zheng
et al. 2024, "SGLang: Efficient Execution of Structured Language Model Programs", arXiv
2312.07104, the compressed finite-state machine): after a constrained row samples a token,
the tokens its grammar then forces (llguidance's ``compute_ff_tokens``: a JSON key, ``":"``,
a closing ``"}``) are appended to its outputs without sampling them. The row is then
partly prefilled (``num_tokens - num_computed_tokens > 1``), so the scheduler's next
prefill step feeds all of them and samples the token after them: one step for several
tokens.

When to jump. A step is either a prefill or a decode step, so a prefill step that only the
jumping rows need stalls every other decoding row for a step. On the CPU (SmolLM2,
benchmarks/jump_forward.py; runs of the first version, not recorded) jumping whenever a row
could made 8 rows 10 % slower, 1 row 8-19 % faster. So rows jump only when no row waits for them: when every decoding row jumps
(one row alone; rows in step), or when a prefill step comes next anyway (a row is partly
prefilled, or the first waiting request has a place and pages), which the jumping rows
then join.

Rows that need every token sampled never jump: ``logprobs`` (one entry a token),
penalties and ``bad_words`` (the device counts and matches each sampled token),
``logit_bias`` and ``allowed_token_ids`` (a forced token would skip them); a running row
with them (or an unconstrained one) blocks the every-row rule. Plain Python; no JAX.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from jaxinfer.prefill_plan import places
from jaxinfer.request_checks import masked_stops

if TYPE_CHECKING:
    from jaxinfer.engine import LLMEngine
    from jaxinfer.sampling_params import SamplingParams
    from jaxinfer.scheduler import Scheduler
    from jaxinfer.sequence import Sequence


def can_jump(sp: SamplingParams) -> bool:
    """Whether a row with ``sp`` may take forced tokens without sampling them."""
    return (sp.structured_outputs is not None and sp.logprobs is None
            and not sp.has_penalties and not sp.bad_words and not sp.logit_bias
            and not sp.allowed_token_ids)


def _decoding(seq: Sequence) -> bool:
    return seq.num_tokens - seq.num_computed_tokens == 1


def _admits(sched: Scheduler) -> bool:
    """Whether the next step would admit the first waiting request: it has a place among
    ``max_num_seqs`` and the pages of its prompt (less a cached prefix) are free."""
    if not sched.waiting:
        return False
    head, bm = sched.waiting[0], sched.block_manager
    if sum(places(s) for s in sched.running) + places(head) > sched.cfg.max_num_seqs:
        return False
    return bm.pages_to_admit(head, bm.match_prefix(head), head.num_tokens) <= bm.num_free_pages


def plan(engine: LLMEngine, rows: list[tuple[Sequence, Any]]
         ) -> list[tuple[Sequence, Any, list[int]]]:
    """Which of ``rows`` (sequences that just sampled a token, with their stream states)
    jump, with the tokens each appends: (seq, state, forced) for each, under the rule in
    the module docstring; [] when none."""
    sched = engine.scheduler
    jumps = []
    for seq, st in rows:
        if not seq.is_finished and can_jump(seq.sampling_params):
            forced = engine.structured.forced(seq)
            if forced:
                jumps.append((seq, st, forced))
    if not jumps:
        return []
    if any(not _decoding(s) for s in sched.running) or _admits(sched):
        return jumps  # a prefill step comes next anyway: the jumping rows join it
    jumping = {seq.key for seq, _, _ in jumps}
    if all(s.key in jumping for s in sched.running):
        return jumps  # every decoding row jumps: nobody waits
    return []


def jump(engine: LLMEngine, rows: list[tuple[Sequence, Any]]) -> list[Sequence]:
    """Append the forced tokens of the rows :func:`plan` picks, each under the rules of a
    sampled token: the ``min_tokens`` mask (a stop token it would mask ends the jump before
    it), the scheduler's stop rules (``Scheduler.append_forced``: EOS and stop ids,
    ``max_tokens``, ``max_model_len``), stop strings, the grammar's end. Adds their count
    to ``engine.num_jump_forward_tokens``; returns the sequences they finished."""
    finished = []
    for seq, st, forced in plan(engine, rows):
        sp = seq.sampling_params
        masked = masked_stops(sp, engine.model_config.vocab_size,
                              engine.scheduler.cfg.eos_token_ids)
        for tok in forced:
            if tok in masked and seq.num_output_tokens < sp.min_tokens:
                break  # the sampler masks it there: the row samples under the mask, as
                # without jumps
            engine.num_jump_forward_tokens += 1
            ended = engine.scheduler.append_forced(seq, tok)
            stop_token = ended and seq.finish_reason == "stop"
            if st.add_token(tok, None, stop_token):  # a stop string ("stop" over "length")
                if not ended:
                    engine.scheduler.finish_sample(seq, "stop")
                seq.finish_reason = "stop"
                ended = True
            if not ended:
                grammar = engine.structured.accept(seq, tok)  # "stop": grammar complete
                if grammar is not None:
                    engine.scheduler.finish_sample(seq, "stop" if grammar == "stop"
                                                   else "abort")
                    ended = True
            if ended:
                finished.append(seq)
                break
    return finished
