"""Serving fixtures: a real gRPC server on a loopback port, run in a background thread with its
own event loop, over a tiny random llama (no tokenizer: prompts are token ids)."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import numpy as np
import pytest

from jaxinfer.llm import LLM
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.serving.server import InferenceServer
from tests.conftest import tiny_loaded

# Few buckets: every program compiles in seconds on the CPU, so keep their number small.
TINY_ARGS = {"max_model_len": 128, "block_size": 8, "max_num_seqs": 32, "decode_buckets": (32,),
                 "max_num_batched_tokens": 64, "prefill_buckets": (64,), "max_prefill_seqs": 4}


class ServerThread:
    """An :class:`InferenceServer` on 127.0.0.1 (free port) in a daemon thread."""

    def __init__(self, engine: Any, **kw: Any) -> None:
        self.engine = engine
        self.kw = kw
        self.server: InferenceServer | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.error: BaseException | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    async def _main(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self.server = InferenceServer(self.engine, host="127.0.0.1", port=0, **self.kw)
        try:
            await self.server.start()
        except BaseException as e:  # noqa: BLE001 - reported by start()
            self.error = e
            self._ready.set()
            return
        self._ready.set()
        await self._stop.wait()
        await self.server.stop(self._grace)

    def start(self, timeout: float = 300.0) -> ServerThread:
        self._thread.start()
        assert self._ready.wait(timeout), "server did not start"
        if self.error is not None:
            raise self.error
        return self

    def stop(self, grace: float = 5.0) -> None:
        self._grace = grace
        if self.loop is not None and self._thread.is_alive():
            self.loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(60)

    @property
    def target(self) -> str:
        assert self.server is not None
        return f"127.0.0.1:{self.server.port}"

    @property
    def et(self):
        assert self.server is not None and self.server.engine_thread is not None
        return self.server.engine_thread


def prompts_and_params(n: int, seed: int = 0) -> tuple[list[list[int]], list[SamplingParams]]:
    """``n`` distinct random prompts (1-40 ids of the tiny vocab) with varied greedy params."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(2, 96, size=int(rng.integers(1, 41))).tolist() for _ in range(n)]
    params = [SamplingParams(temperature=0.0, max_tokens=int(rng.integers(1, 25)),
                             ignore_eos=bool(i % 2)) for i in range(n)]
    return prompts, params


@pytest.fixture(scope="module")
def tiny_server():
    """(ServerThread, offline reference outputs of ``prompts_and_params(200)``).

    The references come from the same engine run offline (``LLM.generate``) before serving.
    """
    llm = LLM(tiny_loaded("llama"), **TINY_ARGS)
    prompts, params = prompts_and_params(200)
    ref = llm.generate(prompts, params)
    st = ServerThread(llm.engine, metrics_port=0).start()
    yield st, prompts, params, ref
    st.stop()


def wait_until(cond, timeout: float = 10.0, interval: float = 0.005) -> float:
    """Poll ``cond()`` until true; returns the seconds it took. Fails the test on timeout."""
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"condition not met within {timeout} s")
        time.sleep(interval)
    return time.monotonic() - t0
