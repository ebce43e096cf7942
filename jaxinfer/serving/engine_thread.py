"""The engine loop in its own thread, fed through a thread-safe inbox (vLLM's
``AsyncLLMEngine`` background loop, with a thread instead of a task: a step blocks on the device).

The event loop of the gRPC server never touches ``LLMEngine``: it puts commands (add, abort,
stop) into a ``queue.Queue``; the engine thread applies them between steps, runs a step, and
hands each request's new tokens back to the event loop with one ``call_soon_threadsafe`` per step
(each request owns an ``asyncio.Queue``). An abort frees the request's pages before the next
step. A fault while producing one request's output fails that request only; a fault in a step
fails the requests running in it, which are aborted (their pages freed), and the loop goes on.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from jaxinfer.sampling_params import SamplingParams
from jaxinfer.sequence import SequenceStatus

if TYPE_CHECKING:
    from jaxinfer.engine import LLMEngine
    from jaxinfer.outputs import Logprobs, RequestOutput
    from jaxinfer.serving.metrics import ServingMetrics

log = logging.getLogger(__name__)


class QueueFull(RuntimeError):
    """The scheduler's waiting queue is at ``max_queue_len`` (gRPC RESOURCE_EXHAUSTED)."""


class Rejected(ValueError):
    """The engine refused the request (gRPC INVALID_ARGUMENT); the message says why."""


class RequestFailed(RuntimeError):
    """The request hit a fault inside the engine thread (gRPC INTERNAL)."""


class EngineStopped(RuntimeError):
    """The engine thread stopped before the request finished (gRPC UNAVAILABLE)."""


@dataclass
class StreamItem:
    """New output of one sample of a request, as produced by one step (from the engine's
    RequestOutput).

    ``index``: the sample (``CompletionOutput.index``); ``token_ids``: its ids generated since
    its previous item; ``text``: what its output text (``CompletionOutput.text``: stop
    strings cut, a possible partial one held back) gained since then; ``logprobs``:
    ``CompletionOutput.logprobs`` entries of ``token_ids`` (None unless requested);
    ``prompt_logprobs``: ``RequestOutput.prompt_logprobs`` on the first item that has them;
    ``finish_reason``: None while the sample runs, then "stop" / "length" / "abort", with
    ``stop_reason`` and ``cumulative_logprob``; ``last``: the request's final item (every
    sample finished); ``error``: set (and nothing else) when the request failed.
    """

    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: BaseException | None = None
    text: str = ""
    logprobs: list[Logprobs] | None = None
    prompt_logprobs: list[Logprobs | None] | None = None
    stop_reason: int | str | None = None
    cumulative_logprob: float | None = None
    index: int = 0
    last: bool = False


class RequestHandle:
    """One request as the server sees it: inputs, and the queue its outputs arrive on.

    Create it on the event loop (the queue binds to the running loop); ``arrival`` (monotonic
    seconds) starts the TTFT and end-to-end clocks.
    """

    def __init__(self, prompt_ids: list[int], params: SamplingParams,
                 prompt_text: str | None = None) -> None:
        self.prompt_ids = prompt_ids
        self.params = params
        self.prompt_text = prompt_text
        self.queue: asyncio.Queue[StreamItem] = asyncio.Queue()
        self.request_id: int = -1  # set by EngineThread.submit
        self.arrival = time.monotonic()
        # Per sample (engine thread only): tokens handed out, and whether its final item was.
        self.num_sent = [0] * params.n
        self.sample_done = [False] * params.n
        self.prompt_logprobs_sent = False  # (engine thread)
        self.last_token_time: float | None = None
        self.finished = False  # set on the event loop when the final item was read


class EngineThread:
    """Runs ``engine.step()`` in a daemon thread while requests come and go.

    Args:
      engine: the ``LLMEngine``; after ``start()`` only this thread may use it.
      loop: the event loop that owns the request handles (outputs are delivered on it).
      metrics: optional :class:`ServingMetrics` updated every step.
      idle_wait_s: how long the idle thread blocks on the inbox before re-checking for stop.
    """

    def __init__(self, engine: LLMEngine, loop: asyncio.AbstractEventLoop,
                 metrics: ServingMetrics | None = None, idle_wait_s: float = 0.1) -> None:
        self.engine = engine
        self.loop = loop
        self.metrics = metrics
        self.idle_wait_s = idle_wait_s
        self._inbox: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._active: dict[int, RequestHandle] = {}
        self._ids = itertools.count()
        self._thread = threading.Thread(target=self._run, name="jaxinfer-engine", daemon=True)
        self._stopped = threading.Event()
        self._lock = threading.Lock()  # orders submit() against the thread's final drain
        self.num_steps = 0
        self.num_step_faults = 0

    # ------------------------------------------------------------- event-loop side
    def start(self) -> None:
        self._thread.start()

    def submit(self, handle: RequestHandle) -> None:
        """Queue ``handle`` for admission at the next step boundary (any thread)."""
        with self._lock:
            if self._stopped.is_set():
                raise EngineStopped("the engine is shutting down")
            handle.request_id = next(self._ids)
            self._inbox.put(("add", handle))

    def abort(self, handle: RequestHandle) -> None:
        """Abort ``handle`` at the next step boundary; its pages are freed then (any thread)."""
        self._inbox.put(("abort", handle))

    def call(self, fn: Any) -> None:
        """Run ``fn(engine)`` in the engine thread between steps (tests, maintenance)."""
        self._inbox.put(("call", fn))

    def request_stop(self) -> None:
        """Ask the thread to abort what is left and end after its current step (any
        thread; returns at once; ``InferenceServer.stop`` waits for it, bounded)."""
        self._inbox.put(("stop", None))

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def num_active(self) -> int:
        return len(self._active)

    # ------------------------------------------------------------- engine-thread side
    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                busy = engine.has_unfinished_requests()
                if not self._drain(block=not busy):
                    return
                if not engine.has_unfinished_requests():
                    continue
                self._step()
        finally:
            with self._lock:
                self._stopped.set()
            self._fail_all(EngineStopped("the server is shutting down"))

    def _drain(self, block: bool) -> bool:
        """Apply queued commands; returns False on stop."""
        try:
            cmd = self._inbox.get(timeout=self.idle_wait_s) if block else self._inbox.get_nowait()
        except queue.Empty:
            return True
        while True:
            kind, arg = cmd
            if kind == "stop":
                return False
            if kind == "add":
                self._add(arg)
            elif kind == "abort":
                self._abort(arg)
            elif kind == "call":
                try:
                    arg(self.engine)
                except Exception:
                    log.exception("engine-thread call failed")
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return True

    def _add(self, h: RequestHandle) -> None:
        from jaxinfer.engine import RequestError
        from jaxinfer.scheduler import QueueFullError

        try:
            # "delta": each step's output holds only what is new (no per-step copy of every
            # running request's tokens and text); _items hands it out as it comes.
            self.engine.add_request(h.prompt_text if h.prompt_text is not None else h.prompt_ids,
                                    replace(h.params, output_kind="delta"),
                                    request_id=h.request_id, prompt_token_ids=h.prompt_ids)
        except QueueFullError as e:  # raised as is by the engine (or wrapped, below)
            self._deliver([(h, StreamItem(error=QueueFull(_client_message(e, h))))])
            return
        except RequestError as e:
            msg = _client_message(e, h)
            err: BaseException = (QueueFull(msg) if isinstance(e.__cause__, QueueFullError)
                                  else Rejected(msg))
            self._deliver([(h, StreamItem(error=err))])
            return
        except Exception as e:
            log.exception("add_request failed for request %d", h.request_id)
            self._deliver([(h, StreamItem(error=RequestFailed(f"{type(e).__name__}: {e}")))])
            return
        self._active[h.request_id] = h
        if self.metrics is not None:
            self.metrics.on_admitted(len(h.prompt_ids))

    def _abort(self, h: RequestHandle) -> None:
        if self._active.pop(h.request_id, None) is not None:
            self.engine.abort_request(h.request_id)
            if self.metrics is not None:
                self.metrics.on_finished(h, "abort")
                self.metrics.refresh_gauges(self.engine)

    def _step(self) -> None:
        try:
            outs = self.engine.step()
        except Exception as e:
            self.num_step_faults += 1
            log.exception("engine step failed")
            sched = self.engine.scheduler
            victims = [v for rid, v in self._active.items()
                       if (s := sched.get(rid)) is not None
                       and s.status is SequenceStatus.RUNNING]
            for v in victims:
                self._active.pop(v.request_id, None)
                self.engine.abort_request(v.request_id)
            err = RequestFailed(f"engine step failed: {type(e).__name__}: {e}")
            self._deliver([(v, StreamItem(error=err)) for v in victims])
            return
        self.num_steps += 1
        now = time.monotonic()
        batch: list[tuple[RequestHandle, StreamItem]] = []
        for out in outs:
            h = self._active.get(out.request_id)
            if h is None:
                continue
            try:
                items = self._items(h, out, now)
            except Exception as e:
                log.exception("output of request %d failed", h.request_id)
                self._active.pop(h.request_id, None)
                self.engine.abort_request(h.request_id)
                items = [StreamItem(error=RequestFailed(f"{type(e).__name__}: {e}"))]
            batch += [(h, item) for item in items]
        if batch:
            self._deliver(batch)
        if self.metrics is not None:
            self.metrics.on_step(self.engine)

    def _items(self, h: RequestHandle, out: RequestOutput, now: float) -> list[StreamItem]:
        """The items of the samples that gained tokens, text or their finish in this step
        (the first one also carries the prompt logprobs); the request's last item has
        ``last`` set."""
        items: list[StreamItem] = []
        plp = None
        if out.prompt_logprobs is not None and not h.prompt_logprobs_sent:
            plp, h.prompt_logprobs_sent = out.prompt_logprobs, True
        for comp in out.outputs:
            i = comp.index
            if h.sample_done[i]:
                continue
            # output_kind "delta" (_add): the step's new tokens, logprobs and text (the engine
            # holds back text a stop string could still cut, so text only ever grows).
            new, lps, text = comp.token_ids, comp.logprobs, comp.text
            h.num_sent[i] += len(new)
            done = comp.finish_reason is not None
            if not (new or text or done or plp is not None):
                continue
            item = StreamItem(new, comp.finish_reason, text=text, logprobs=lps,
                              prompt_logprobs=plp, index=i)
            if done:
                h.sample_done[i] = True
                item.stop_reason, item.cumulative_logprob = (comp.stop_reason,
                                                             comp.cumulative_logprob)
            items.append(item)
            plp = None
        num_new = sum(len(it.token_ids) for it in items)
        if self.metrics is not None and num_new:
            self.metrics.on_tokens(h, num_new, now)
        h.last_token_time = now if num_new else h.last_token_time
        if out.finished:
            self._active.pop(h.request_id, None)
            if not items:  # every sample's final item went out in earlier steps
                items.append(StreamItem(index=out.outputs[0].index))
            items[-1].last = True
            if self.metrics is not None:
                self.metrics.on_finished(h, out.outputs[0].finish_reason or "stop", now)
        return items

    def _fail_all(self, err: BaseException) -> None:
        batch = []
        for rid, h in list(self._active.items()):
            try:
                self.engine.abort_request(rid)
            except Exception:
                log.warning("abort of request %d failed at shutdown", rid, exc_info=True)
            batch.append((h, StreamItem(error=err)))
        self._active.clear()
        while True:  # requests queued but never admitted
            try:
                kind, arg = self._inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "add":
                batch.append((arg, StreamItem(error=err)))
        if batch:
            self._deliver(batch)

    def _deliver(self, batch: list[tuple[RequestHandle, StreamItem]]) -> None:
        def put() -> None:
            for h, item in batch:
                h.queue.put_nowait(item)

        try:
            self.loop.call_soon_threadsafe(put)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass


def _client_message(err: BaseException, h: RequestHandle) -> str:
    """An engine admission error for the client: without its leading "request <id>: ", the
    engine's own number, which the client never saw (its request_id is a string) and which
    the RPC's error need not name."""
    return str(err).removeprefix(f"request {h.request_id}: ")
