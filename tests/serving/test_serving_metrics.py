"""ServingMetrics' engine-step hook against a stand-in engine (no JAX, no server)."""

from __future__ import annotations

from types import SimpleNamespace

from jaxinfer.serving.metrics import ServingMetrics


def _engine(preemptions: int, running: int = 3, waiting: int = 1,
            jumped: int = 0) -> SimpleNamespace:
    bm = SimpleNamespace(num_pages=11, num_free_pages=4)
    sched = SimpleNamespace(block_manager=bm, num_running=running, num_waiting=waiting,
                            num_preemptions_total=preemptions)
    return SimpleNamespace(scheduler=sched, runner=SimpleNamespace(num_compilations=2),
                           num_jump_forward_tokens=jumped)


def test_on_step_counts_preemptions_and_jumped_tokens_once_each() -> None:
    m = ServingMetrics()
    for total in (0, 2, 2, 5):  # the engine's running totals after each step
        m.on_step(_engine(total, jumped=3 * total))
    assert m.preemptions._value.get() == 5
    assert m.jump_forward_tokens._value.get() == 15
    assert m.steps._value.get() == 4
    assert (m.running._value.get(), m.waiting._value.get()) == (3, 1)
    assert (m.pages_total._value.get(), m.pages_used._value.get()) == (10, 6)
