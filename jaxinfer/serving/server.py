"""The gRPC server: ``jaxinfer.v1.Inference`` + ``grpc.health.v1.Health`` + server reflection on
``grpc.aio``, the engine in its own thread, Prometheus metrics on a side port.

Lifecycle: ``start()`` binds the port with health NOT_SERVING, warms the engine up (compiles
the programs every request needs), starts the engine thread and turns health to SERVING.
``stop(grace)`` turns health to NOT_SERVING, stops accepting RPCs, lets in-flight streams run
for up to ``grace`` seconds (then cancels them, which aborts their requests), and ends the
engine thread. ``jaxinfer serve`` calls ``stop`` on SIGTERM / SIGINT and exits 0.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
import socket
import sys
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from jaxinfer.config import ConfigError
from jaxinfer.serving import DEFAULT_PORT
from jaxinfer.serving import jaxinfer_pb2 as pb
from jaxinfer.serving.engine_thread import EngineThread
from jaxinfer.serving.metrics import ServingMetrics
from jaxinfer.serving.servicer import InferenceServicer, add_to_server
from jaxinfer.warmup import freeze_gc_heap, resolve_warmup, unfreeze_gc_heap, warm_up

if TYPE_CHECKING:
    from jaxinfer.engine import LLMEngine

log = logging.getLogger(__name__)

# How long stop() waits for the engine thread to end its step: normally, and after stop_now()
# (a second signal), where a program build in progress is not waited out.
ENGINE_STOP_TIMEOUT_S = 10.0
STOP_NOW_TIMEOUT_S = 1.0

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Inference"].full_name  # "jaxinfer.v1.Inference"


class ServerError(RuntimeError):
    """The server cannot start (e.g. the port cannot be bound)."""


def host_port(host: str, port: int | str) -> str:
    """``host:port`` with an IPv6 address in brackets (``[::1]:50051``), as gRPC and URLs
    take it; ``host`` may come with or without them (``serve --host ::1`` used to load the
    model and then fail in gRPC with "Misformatted domain name")."""
    bare = host.strip("[]")
    return f"[{bare}]:{port}" if ":" in bare else f"{bare}:{port}"


def check_port_free(host: str, port: int, what: str = "listen") -> None:
    """Raise ServerError now if ``host:port`` cannot be bound (taken, or not an address of this
    machine), so ``jaxinfer serve`` fails before spending seconds loading a model. Binds a
    probe socket with SO_REUSEADDR, as gRPC's listener does, and closes it; port 0 always
    passes. The server's own bind still decides (the port may be taken in between)."""
    if not 0 <= port <= 65535:  # getaddrinfo would wrap it modulo 65536
        raise ServerError(f"cannot {what} on {host}:{port}: a port is in [0, 65535]")
    if not port:
        return
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(
            host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(addr)
    except OSError as e:
        raise ServerError(f"cannot {what} on {host}:{port}: {e.strerror or e}") from e


def set_max_queue_len(engine: LLMEngine, max_queue_len: int | None) -> None:
    """Bound the scheduler's waiting queue (``SchedulerConfig.max_queue_len``); past it
    ``add_request`` fails with QueueFullError (-> RESOURCE_EXHAUSTED). Call before serving.

    Raises ConfigError on a value that is not None or a positive int.
    """
    sched = engine.scheduler
    sched.cfg = dataclasses.replace(sched.cfg, max_queue_len=max_queue_len)


class InferenceServer:
    """One engine behind a gRPC endpoint.

    Args:
      engine: an ``LLMEngine``; the server's engine thread owns it from ``start()`` on.
      host / port: where to listen (port 0 picks a free one; see ``self.port``).
      metrics_port: Prometheus ``/metrics`` port on ``host`` (None: no HTTP endpoint; 0: any).
      max_queue_len: most waiting requests before RESOURCE_EXHAUSTED (None: the engine's
        own ``SchedulerConfig.max_queue_len``, unbounded by default).
      warmup: compile the common programs before reporting SERVING (see :func:`warm_up`);
        ``"prefill"``: every prefill program too (``warm_up(prefill_buckets=True)``);
        ``"auto"`` (default): ``"prefill"`` on a GPU, ``True`` on the CPU
        (:func:`jaxinfer.warmup.resolve_warmup`); False: none. After it ``start`` freezes the
        garbage collector's heap (:func:`jaxinfer.warmup.freeze_gc_heap`, as vLLM), ``stop``
        unfreezes it.
    Raises:
      ConfigError: bad max_queue_len or warmup. ServerError (from ``start``): the port
        cannot be bound.
    """

    def __init__(self, engine: LLMEngine, host: str = "127.0.0.1", port: int = DEFAULT_PORT,
                 metrics_port: int | None = None, max_queue_len: int | None = None,
                 warmup: bool | str = "auto") -> None:
        try:
            self.warmup = resolve_warmup(warmup)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        self.engine = engine
        self.host = host
        self.port = port
        self.metrics_port = metrics_port
        if max_queue_len is not None:  # else keep the engine's own setting
            set_max_queue_len(engine, max_queue_len)
        self.metrics = ServingMetrics()
        self.engine_thread: EngineThread | None = None
        self.health = health.aio.HealthServicer()
        self._server: grpc.aio.Server | None = None
        self._servicer: InferenceServicer | None = None
        self.warmup_seconds = 0.0
        self._stopping_now = False
        self._pending: list[asyncio.Future] = []

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.engine_thread = EngineThread(self.engine, loop, self.metrics)
        server = self._server = grpc.aio.server(options=[
            ("grpc.so_reuseport", 0),  # a second server on a taken port must fail, not share
            ("grpc.max_receive_message_length", 64 * 2**20)])
        self._servicer = InferenceServicer(self.engine_thread, self.metrics)
        add_to_server(self._servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        try:
            port = server.add_insecure_port(host_port(self.host, self.port))
        except RuntimeError as e:
            raise ServerError(f"cannot listen on {host_port(self.host, self.port)}: {e}"
                              ) from e
        if port == 0:
            raise ServerError(f"cannot listen on {host_port(self.host, self.port)}")
        self.port = port
        await server.start()
        if self.metrics_port is not None:
            try:
                self.metrics_port = self.metrics.serve_http(self.metrics_port,
                                                            self.host.strip("[]"))
            except OSError as e:
                await server.stop(None)
                raise ServerError(f"cannot serve metrics on "
                                  f"{host_port(self.host, self.metrics_port)}: "
                                  f"{e.strerror or e}") from e
        if self.warmup:  # health answers NOT_SERVING meanwhile
            self.warmup_seconds = await loop.run_in_executor(
                None, lambda: warm_up(self.engine, prefill_buckets=self.warmup == "prefill"))
            log.info("warm-up: %.1f s, %d programs compiled", self.warmup_seconds,
                     self.engine.runner.num_compilations)
        # as vLLM after its warm-up: later collections skip what start-up made
        log.info("froze %d objects out of the garbage collector's reach", freeze_gc_heap())
        self.metrics.on_step(self.engine)
        self.engine_thread.start()
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)

    async def stop(self, grace: float | None = 30.0) -> None:
        """Drain and stop: NOT_SERVING, no new RPCs, in-flight ones get ``grace`` seconds;
        then the engine thread gets up to ``ENGINE_STOP_TIMEOUT_S`` to end its step (one
        that builds a program can take seconds), or ``STOP_NOW_TIMEOUT_S`` after
        :meth:`stop_now`; a thread still busy then is left behind (a daemon) with a warning."""
        await self.health.enter_graceful_shutdown()
        if self._server is not None:
            await self._server.stop(grace)
        if self.engine_thread is not None:
            await self._join_engine_thread(self.engine_thread)
        if self._pending:  # stop_now's cancelling stop()
            await asyncio.gather(*self._pending)
        if self._servicer is not None:
            self._servicer.close()
        self.metrics.close()
        unfreeze_gc_heap()

    def stop_now(self) -> None:
        """Cancel the in-flight RPCs (their requests are aborted) and cut the wait for the
        engine thread to ``STOP_NOW_TIMEOUT_S``: the second SIGTERM / SIGINT of ``serve``.
        Call it on the event loop while :meth:`stop` runs."""
        self._stopping_now = True
        if self._server is not None:  # the smaller grace wins (grpc.aio Server.stop)
            self._pending.append(asyncio.ensure_future(self._server.stop(None)))

    async def _join_engine_thread(self, thread: EngineThread) -> None:
        thread.request_stop()
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        while thread.is_alive:
            limit = STOP_NOW_TIMEOUT_S if self._stopping_now else ENGINE_STOP_TIMEOUT_S
            if loop.time() - t0 >= limit:
                log.warning("the engine thread is still in a step after %.1f s (building a "
                            "program?): not waiting for it", loop.time() - t0)
                break
            await asyncio.sleep(0.02)

    async def wait_for_termination(self) -> None:
        if self._server is not None:
            await self._server.wait_for_termination()


async def serve(engine: LLMEngine, host: str, port: int, metrics_port: int | None = None,
                max_queue_len: int | None = None, drain_timeout: float = 30.0,
                warmup: bool | str = "auto", ready: Any = None) -> int:
    """Serve until SIGTERM / SIGINT, then drain for up to ``drain_timeout`` s (a second
    signal cancels what is in flight and stops at once, as vLLM's server does); returns 0."""
    server = InferenceServer(engine, host, port, metrics_port, max_queue_len, warmup)
    await server.start()
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    msg = f"jaxinfer: serving {engine.model_name} on {host_port(host, server.port)}"
    if server.metrics_port is not None:
        msg += f", metrics on http://{host_port(host, server.metrics_port)}/metrics"
    print(msg, file=sys.stderr, flush=True)
    if ready is not None:
        ready(server)
    await stop.wait()
    print(f"jaxinfer: draining (up to {drain_timeout:g} s; signal again to stop now)",
          file=sys.stderr, flush=True)

    def stop_now() -> None:  # a second SIGINT / SIGTERM (used to be ignored until the end)
        print("jaxinfer: stopping now: in-flight requests are cancelled", file=sys.stderr,
              flush=True)
        server.stop_now()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop_now)
    await server.stop(drain_timeout)
    print("jaxinfer: stopped", file=sys.stderr, flush=True)
    return 0


__all__ = [
    "SERVICE_NAME",
    "check_port_free",
    "ConfigError",
    "InferenceServer",
    "ServerError",
    "serve",
    "set_max_queue_len",
    "warm_up",
]
