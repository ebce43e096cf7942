"""Multi-step decode (``EngineConfig.num_scheduler_steps = k``): the plan of k decode steps
run by one compiled program. Plain Python; no JAX (the program: runner_multi.py).

After vLLM's multi-step scheduling (``--num-scheduler-steps``, vllm/engine/output_processor/
multi_step.py and worker/multi_step_model_runner.py): a decode step's host cost -- the
launch of the model program (on XLA:GPU one CUDA graph of ~600-800 nodes, ~2 us of host time
a node), the sampler's, the step's Python -- exceeds the device time of a small batch (the
8B FP8 step at batch 1: ~5.6 ms of host around ~2.9 ms of device, benchmarks/RESULTS.md), so
one program runs k steps, each feeding its sampled tokens to the next on the device, and
the host pays that cost once per k tokens.

A decode step ``out`` the scheduler planned runs as k steps when

* every running sequence has a row in it (none is mid-prefill), each feeding its last token,
  and no row forks samples (``page_copies``) in it;
* no row asks for logprobs (the k-step program returns tokens only);
* every row's positions stay inside ``max_model_len`` for all k steps;
* nothing is waiting, or the one-step scheduler could admit none of the waiting sequences
  now (``engine_async.admission_blocked``);
* the pages for all k tokens of every row come from free pages (no preemption;
  ``engine_async.pages_ahead``: never-cached ones only while a request waits).

Otherwise the step runs as one. The host then applies each of the k steps in order, as the
one-step engine would (``Scheduler.postprocess``, stop strings, outputs): a row that stops at
step j (EOS, a stop token or string, ``max_tokens``) has its later tokens discarded and the
pages allocated ahead for it freed with it; its penalty-count row, which saw the discarded
tokens, is rewritten before another sequence with penalties uses the slot (as for the async
engine's wasted row). Tokens and finish reasons equal the one-step engine's (sampling keys
are per request and token); a request waiting for the place of a row that stops mid-window is
admitted at the window's end, up to k - 1 steps later than the one-step engine would.
With async scheduling the engine also dispatches the next window before reading one back
(engine_multi.py, ``engine_async.plan_next_decode(window=k)``).
"""

from __future__ import annotations

from jaxinfer.engine_async import admission_blocked, pages_ahead
from jaxinfer.scheduler import Scheduler
from jaxinfer.scheduler_types import ScheduledChunk, SchedulerOutput
from jaxinfer.sequence import SequenceStatus


def plan_multi_step(scheduler: Scheduler, out: SchedulerOutput, k: int,
                    max_model_len: int) -> list[SchedulerOutput] | None:
    """The k one-step plans of decode step ``out`` (just scheduled) when it can run as k
    steps (module docstring), with the pages for all k tokens of every row allocated;
    None when it cannot (nothing allocated).

    Args:
      scheduler: the engine's scheduler, ``out`` its last plan.
      out: a plan from ``scheduler.schedule()``, not yet run.
      k: steps per program (``EngineConfig.num_scheduler_steps``).
      max_model_len: the engine's.
    Returns:
      ``[out, step 1, ..., step k-1]``: step j has one chunk per row of ``out``, in the same
      order, feeding the token step j - 1 samples; apply them in order with
      ``Scheduler.postprocess`` (finished rows are skipped).
    """
    if k <= 1 or out.is_prefill or not out.chunks or out.page_copies:
        return None
    if len(out.chunks) != len(scheduler.running):
        return None
    for c in out.chunks:
        seq = c.seq
        if (c.num_tokens != 1 or not c.samples or seq.fork_pending
                or seq.status is not SequenceStatus.RUNNING
                or seq.sampling_params.logprobs is not None
                or seq.sampling_params.structured_outputs is not None  # a mask a token
                or seq.num_tokens + k - 1 > max_model_len):  # positions fed < max_model_len
            return None
    if scheduler.waiting and not admission_blocked(scheduler, out.chunks):
        return None
    bm = scheduler.block_manager
    need = sum(bm.pages_needed(c.seq, k) for c in out.chunks)  # tokens start .. start + k - 1
    if need > pages_ahead(scheduler):
        return None
    for c in out.chunks:
        bm.allocate(c.seq, k)
    steps = [out]
    for j in range(1, k):
        chunks = []
        for c in out.chunks:
            nxt = ScheduledChunk(c.seq, c.start + j, 1)
            nxt._samples = True  # it ends at the token step j - 1 samples
            chunks.append(nxt)
        steps.append(SchedulerOutput(False, chunks))
    return steps
