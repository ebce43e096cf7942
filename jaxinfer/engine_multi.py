"""The engine's multi-step windows (``EngineConfig.num_scheduler_steps`` k > 1): launching a
window of k decode steps and, with ``async_scheduling``, the next window before the one in
flight is read back. The plans: multi_step.py (a window from a scheduled step) and
engine_async.plan_next_decode (``window=k``: the next window); the program: runner_multi.py.

Pipelined windows follow the async engine's one-step pipelining (engine_async.py): window
n+1 feeds, on the device, the tokens window n samples last (``ModelRunner.gather_tokens``);
the host reads window n back while n+1 runs and records its k steps. A row that stops inside
window n (EOS, a stop token or string) runs wasted in window n+1: its tokens are discarded
and its pages freed with it. Nothing may wait for a window to pipeline, so a request that
arrives while a window is in flight is admitted after it (up to 2k steps later than the
one-step engine would; vLLM's multi-step scheduling behaves alike). Tokens and finish reasons
are the one-step engine's.

A window whose k-step program is not built yet (a sampler variant the warm-up leaves out:
``runner_multi.warm_variants``) runs as one step while that program builds on a
background thread, when the one-step program it falls back to is built (after a server's
warm-up); its next windows take the k-step program once it is ready. So a server's first
top-p request does not stop every stream for a compile (several seconds for an 8B model on
a GPU). Without a built one-step program (an offline run without warm-up) the k-step program
is built at once, as before: the fallback would compile too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from jaxinfer.batch import StepInputs
from jaxinfer.engine_async import plan_next_decode
from jaxinfer.multi_step import plan_multi_step
from jaxinfer.scheduler_types import SchedulerOutput

if TYPE_CHECKING:
    from jaxinfer.engine import LLMEngine


class Window(NamedTuple):
    """A dispatched multi-step window: its k one-step plans, host inputs and device output."""

    steps: list[SchedulerOutput]
    inputs: StepInputs
    tokens: Any  # [k, S] int32 on the device
    last: Any  # [S] int32 on the device: the last step's tokens

    def fetch(self) -> np.ndarray:
        """Wait for the window: its [k, S] tokens on the host."""
        return np.asarray(self.tokens)


def launch_window(engine: LLMEngine, out: SchedulerOutput) -> Window | None:
    """Dispatch decode step ``out`` (just scheduled) as a window of ``num_scheduler_steps``
    steps; None when it must run as one step (multi_step.plan_multi_step; a window whose
    inputs the vectorized path cannot build keeps its pages for the next steps)."""
    ec, k = engine.config, engine.config.num_scheduler_steps
    steps = plan_multi_step(engine.scheduler, out, k, ec.max_model_len)
    if steps is None:
        return None
    inputs = engine._rows.build_decode(out.chunks, seq_buckets=ec.decode_buckets,
                                       page_buckets=ec.page_buckets,
                                       request_seeds=engine._seeds, lookahead=k - 1)
    if inputs is None or _one_step_meanwhile(engine, out, inputs, k):
        return None  # its pages stay allocated: the next steps use them
    engine.num_multi_steps += 1
    return Window(steps, inputs, *engine.multi_step_programs.launch(inputs, k))


def launch_next_window(engine: LLMEngine, cur: Window) -> Window | None:
    """Dispatch the window after ``cur`` (in flight) if it pipelines
    (``plan_next_decode(window=k)``); else None."""
    ec, k = engine.config, engine.config.num_scheduler_steps
    nxt = plan_next_decode(engine.scheduler, cur.steps[0], cur.inputs.bucket.num_seqs,
                           ec.decode_buckets, ec.max_model_len, window=k)
    if nxt is None:
        return None
    inputs = engine._rows.build_decode(nxt.out.chunks, seq_buckets=ec.decode_buckets,
                                       page_buckets=ec.page_buckets,
                                       request_seeds=engine._seeds, token_on_device=k,
                                       lookahead=k - 1)
    if (inputs is None or inputs.bucket.num_seqs != len(nxt.rows) or not
            engine.multi_step_programs.ready(inputs.bucket, engine.multi_step_programs.variant(
                inputs), k)):  # the next synchronous plan decides (launch_window)
        return None  # its pages stay allocated: the next synchronous plan uses them
    engine.num_multi_steps += 1
    engine.num_pipelined_windows += 1
    token_ids = engine.runner.gather_tokens(cur.last, nxt.rows)
    return Window(nxt.steps, inputs, *engine.multi_step_programs.launch(inputs, k, token_ids))


def _one_step_meanwhile(engine: LLMEngine, out: SchedulerOutput, inputs: StepInputs,
                        k: int) -> bool:
    """Whether window ``inputs`` runs as one step while its k-step program builds in the
    background (module docstring): the program is not built, and the one-step program of
    ``out`` is (else the k-step one is built now, by the caller). Counted in
    ``engine.num_one_step_windows``."""
    progs = engine.multi_step_programs
    key = (inputs.bucket, progs.variant(inputs), k)
    if progs.ready(*key):
        return False
    if key not in progs.failed and not progs.building(*key):  # (checked when it started)
        one = engine._inputs(out.chunks, False)  # what the fallback runs
        if one is None or not engine.runner.has_sample_program(one.bucket):
            return False
        progs.build_in_background(*key)  # another key building: asked again next window
    engine.num_one_step_windows += 1
    return True
