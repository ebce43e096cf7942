"""ServingMetrics' engine-step hook against a stand-in engine (no JAX, no server)."""

from __future__ import annotations

from types import SimpleNamespace

from jaxinfer.serving.metrics import ServingMetrics


def _engine(preemptions: int, running: int = 3, waiting: int = 1) -> SimpleNamespace:
    bm = SimpleNamespace(num_pages=11, num_free_pages=4)
    sched = SimpleNamespace(block_manager=bm, num_running=running, num_waiting=waiting,
                            num_preemptions_total=preemptions)
    return SimpleNamespace(scheduler=sched, runner=SimpleNamespace(num_compilations=2))


def test_on_step_counts_preemptions_once_each() -> None:
    m = ServingMetrics()
    for total in (0, 2, 2, 5):  # the scheduler's running total after each step
        m.on_step(_engine(total))
    assert m.preemptions._value.get() == 5
    assert m.steps._value.get() == 4
    assert (m.running._value.get(), m.waiting._value.get()) == (3, 1)
    assert (m.pages_total._value.get(), m.pages_used._value.get()) == (10, 6)
