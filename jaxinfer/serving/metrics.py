"""Prometheus metrics of the server (prometheus-client), names after vLLM's ``vllm:*`` set.

Each server owns a ``CollectorRegistry`` (several servers can live in one process, e.g. in
tests). Latencies are measured in the engine thread from the moment the server received the
request (``RequestHandle.arrival``): TTFT to the step that produced the first token, ITL between
steps that produced tokens of the same request, end-to-end to the finishing step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

if TYPE_CHECKING:
    from jaxinfer.serving.engine_thread import RequestHandle

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                    1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class ServingMetrics:
    """Counters, gauges and histograms of one server (all prefixed ``jaxinfer_``)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()
        self.requests = Counter("jaxinfer_requests", "Finished or rejected requests by outcome "
                                "(stop, length, abort, invalid_argument, resource_exhausted, "
                                "error)", ["outcome"], registry=r)
        self.prompt_tokens = Counter("jaxinfer_prompt_tokens", "Prompt tokens admitted",
                                     registry=r)
        self.generation_tokens = Counter("jaxinfer_generation_tokens", "Tokens generated",
                                         registry=r)
        self.ttft = Histogram("jaxinfer_time_to_first_token_seconds", "Arrival to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("jaxinfer_inter_token_latency_seconds",
                             "Time between token-producing steps of one request",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("jaxinfer_e2e_request_latency_seconds", "Arrival to finish",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.running = Gauge("jaxinfer_num_requests_running", "Sequences running", registry=r)
        self.waiting = Gauge("jaxinfer_num_requests_waiting", "Sequences waiting", registry=r)
        self.pages_used = Gauge("jaxinfer_kv_pages_in_use", "KV pages allocated to sequences",
                                registry=r)
        self.pages_total = Gauge("jaxinfer_kv_pages_total", "Usable KV pages (null page "
                                 "excluded)", registry=r)
        self.compilations = Gauge("jaxinfer_num_compilations", "Programs compiled by the runner "
                                  "(constant after warm-up)", registry=r)
        self.loaded = Gauge("jaxinfer_num_programs_loaded", "Programs loaded from a compile "
                            "cache instead of compiled", registry=r)
        self.steps = Counter("jaxinfer_engine_steps", "Engine steps run", registry=r)
        self.preemptions = Counter("jaxinfer_num_preemptions", "Recompute preemptions: a "
                                   "running sequence lost its KV pages to make room",
                                   registry=r)
        self.jump_forward_tokens = Counter(
            "jaxinfer_jump_forward_tokens", "Structured-output tokens a grammar forced, "
            "appended without sampling (jump-forward decoding)", registry=r)
        self._preemptions_seen = self._jumped_seen = 0
        self._http: Any = None

    # engine-thread hooks -------------------------------------------------------------------
    def on_admitted(self, num_prompt_tokens: int) -> None:
        self.prompt_tokens.inc(num_prompt_tokens)

    def on_tokens(self, h: RequestHandle, n: int, now: float) -> None:
        self.generation_tokens.inc(n)
        if h.last_token_time is None:
            self.ttft.observe(now - h.arrival)
        else:
            self.itl.observe(now - h.last_token_time)

    def on_finished(self, h: RequestHandle, reason: str, now: float | None = None) -> None:
        self.requests.labels(reason).inc()
        if now is not None:
            self.e2e.observe(now - h.arrival)

    def on_rejected(self, outcome: str) -> None:
        self.requests.labels(outcome).inc()

    def on_step(self, engine: Any) -> None:
        self.steps.inc()
        total = engine.scheduler.num_preemptions_total  # only grows (one per engine)
        if total > self._preemptions_seen:
            self.preemptions.inc(total - self._preemptions_seen)
        self._preemptions_seen = total
        jumped = getattr(engine, "num_jump_forward_tokens", 0)  # only grows, too
        if jumped > self._jumped_seen:
            self.jump_forward_tokens.inc(jumped - self._jumped_seen)
        self._jumped_seen = jumped
        self.refresh_gauges(engine)

    def refresh_gauges(self, engine: Any) -> None:
        """Set the gauges (running, waiting, pages, programs) from the engine now: after a
        step, and after an abort, which frees pages without one (an idle server's gauges
        used to keep the aborted request's numbers until the next request)."""
        sched = engine.scheduler
        bm = sched.block_manager
        self.running.set(sched.num_running)
        self.waiting.set(sched.num_waiting)
        self.pages_total.set(bm.num_pages - 1)
        self.pages_used.set(bm.num_pages - 1 - bm.num_free_pages)
        self.compilations.set(engine.runner.num_compilations)
        self.loaded.set(getattr(engine.runner, "num_loaded", 0))

    # exposition ----------------------------------------------------------------------------
    def serve_http(self, port: int, host: str = "127.0.0.1") -> int:
        """Expose ``/metrics`` on ``host:port`` (0 picks a free port); returns the port."""
        self._http, _thread = start_http_server(port, addr=host, registry=self.registry)
        return int(self._http.server_address[1])

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
