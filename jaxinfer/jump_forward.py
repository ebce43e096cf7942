"""Jump-forward decoding of structured outputs (``EngineConfig.jump_forward``; SGLang's, Zheng
et al. 2024, "SGLang: Efficient Execution of Structured Language Model Programs", arXiv
2312.07104, the compressed finite-state machine): after a constrained row samples a token,
the tokens its grammar then forces (llguidance's ``compute_ff_tokens``: a JSON key, ``":"``,
a closing ``"}``) are appended to its outputs without sampling them. The row is then
partly prefilled (``num_tokens - num_computed_tokens > 1``), so the scheduler's next
prefill step feeds all of them and samples the token after them: one step for several
tokens.

When to jump. A step is either a prefill or a decode step, so a prefill step that only the
jumping rows need stalls every other decoding row for a step: a first version that jumped
whenever a row could ran 8 rows slower than no jumps on the CPU (benchmarks/jump_forward.py;
those runs were not kept). So rows jump only when no row waits for them: when every
decoding row jumps (one row alone; rows in step), or when a prefill step comes next anyway
(a row is partly prefilled, or the first waiting request has a place and pages), which the
jumping rows then join.

Rows that need every token sampled never jump: ``logprobs`` (one entry a token),
penalties and ``bad_words`` (the device counts and matches each sampled token),
``logit_bias`` and ``allowed_token_ids`` (a forced token would skip them); a running row
with them (or an unconstrained one) blocks the every-row rule. This module is the policy
(:func:`plan`); ``engine_outputs.append_forced`` appends the tokens. Plain Python; no JAX.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from jaxinfer.prefill_plan import places

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
    rows = [(seq, st) for seq, st in rows
            if not seq.is_finished and can_jump(seq.sampling_params)]
    # A prefill step comes next anyway (the jumping rows join it), or every running row
    # must jump (nobody waits): checked before asking the grammars, the costly part.
    coming = any(not _decoding(s) for s in sched.running) or _admits(sched)
    if not coming and len(rows) != len(sched.running):  # (rows: running, distinct)
        return []
    jumps = [(seq, st, forced) for seq, st in rows
             if (forced := engine.structured.forced(seq))]
    return jumps if coming or len(jumps) == len(sched.running) else []
