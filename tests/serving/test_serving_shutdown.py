"""``jaxinfer serve``: SIGTERM stops accepting, drains in-flight streams, exits 0 (a
subprocess); a taken port fails in one line before the model loads."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest

from jaxinfer.serving.client import InferenceClient

ROOT = Path(__file__).resolve().parents[2]


def test_sigterm_drains_in_flight_streams_and_exits_0(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               # share compiled programs with the rest of the suite (tests/conftest.py)
               JAX_COMPILATION_CACHE_DIR=str(ROOT / ".cache" / "jax-test-compilation-cache"),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    cmd = [sys.executable, "-m", "jaxinfer.cli", "serve", "--model", "dummy:tiny-llama",
           "--port", "0", "--max-model-len", "512", "--block-size", "16", "--max-num-seqs", "1",
           "--drain-timeout", "60"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    port: list[int] = []

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)
            m = re.search(r"serving \S+ on 127\.0\.0\.1:(\d+)", line)
            if m:
                port.append(int(m.group(1)))

    threading.Thread(target=read, daemon=True).start()
    try:
        t0 = time.monotonic()
        while not port:
            assert proc.poll() is None, "".join(lines)
            assert time.monotonic() - t0 < 240, "server did not start:\n" + "".join(lines)
            time.sleep(0.1)
        target = f"127.0.0.1:{port[0]}"
        with InferenceClient(target, timeout=120) as c:
            assert c.health() == "SERVING"
            stream = c.generate_stream(token_ids=[5, 6, 7], max_tokens=400, ignore_eos=True,
                                       temperature=0.0)
            got = list(next(stream).token_ids)
            proc.send_signal(signal.SIGTERM)
            for r in stream:  # the in-flight stream runs to its end
                got += r.token_ids
                last = r
            assert len(got) == 400 and last.finish_reason == 2  # FINISH_REASON_LENGTH
        assert proc.wait(60) == 0, "".join(lines)
        assert any("draining" in ln for ln in lines)
        with InferenceClient(target, timeout=2) as c, pytest.raises(grpc.RpcError):
            c.health()  # no longer listening
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("which", ["grpc", "metrics"])
def test_a_taken_port_fails_in_one_line_before_the_model_loads(monkeypatch, capsys, which):
    import socket

    from jaxinfer import engine as engine_module
    from jaxinfer.cli import main

    def no_engine(*args, **kw):
        raise AssertionError("the model was loaded before the port was checked")

    monkeypatch.setattr(engine_module.LLMEngine, "__init__", no_engine)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        ports = (["--port", str(port)] if which == "grpc"
                 else ["--port", "0", "--metrics-port", str(port)])
        assert main(["serve", "--model", "dummy:tiny-llama", *ports]) == 2
    what = "listen" if which == "grpc" else "serve metrics"
    assert capsys.readouterr().err.strip().splitlines() == [
        f"jaxinfer: error: cannot {what} on 127.0.0.1:{port}: Address already in use"]


def test_server_start_with_a_taken_metrics_port_is_a_server_error():
    """The bind inside start() (the port taken after the CLI's check) raises ServerError
    naming the port and leaves no gRPC server running."""
    import asyncio
    import socket

    from jaxinfer.llm import LLM
    from jaxinfer.serving.server import InferenceServer, ServerError
    from tests.conftest import tiny_loaded
    from tests.serving.conftest import TINY_ARGS

    llm = LLM(tiny_loaded("llama"), **TINY_ARGS)

    async def start(port: int) -> InferenceServer:
        server = InferenceServer(llm.engine, port=0, metrics_port=port, warmup=False)
        with pytest.raises(ServerError, match=rf"cannot serve metrics on 127\.0\.0\.1:{port}: "
                                              r"Address already in use"):
            await server.start()
        return server

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server = asyncio.run(start(port))
    with pytest.raises(grpc.RpcError):  # nothing listens on the gRPC port any more
        with InferenceClient(f"127.0.0.1:{server.port}", timeout=2) as c:
            c.health()


@pytest.mark.parametrize("host", ["::1", "[::1]"])
def test_an_ipv6_host_serves_grpc_and_metrics(host):
    """``serve --host ::1`` used to load the model, then fail in gRPC ("Misformatted domain
    name"); ``[::1]`` served gRPC but not the metrics ("Name or service not known")."""
    import asyncio
    import urllib.request

    from jaxinfer.llm import LLM
    from jaxinfer.serving.server import InferenceServer, host_port
    from tests.conftest import tiny_loaded
    from tests.serving.conftest import TINY_ARGS

    assert host_port(host, 5) == "[::1]:5" and host_port("127.0.0.1", 5) == "127.0.0.1:5"
    import socket

    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback on this machine")
    llm = LLM(tiny_loaded("llama"), **TINY_ARGS)

    async def run() -> tuple[str, bytes]:
        server = InferenceServer(llm.engine, host=host, port=0, metrics_port=0, warmup=False)
        await server.start()
        try:
            loop = asyncio.get_running_loop()

            def probe() -> tuple[str, bytes]:
                with InferenceClient(f"[::1]:{server.port}", timeout=10) as c:
                    health = c.health()
                url = f"http://[::1]:{server.metrics_port}/metrics"
                return health, urllib.request.urlopen(url, timeout=10).read()

            return await loop.run_in_executor(None, probe)
        finally:
            await server.stop(None)

    health, metrics = asyncio.run(run())
    assert health == "SERVING" and b"jaxinfer_num_requests_running" in metrics


@pytest.mark.parametrize("long_step", [False, True], ids=["steps", "a-step-building"])
def test_a_second_signal_stops_at_once_instead_of_draining(long_step):
    """The first SIGTERM drains (up to --drain-timeout); a second one cancels the in-flight
    stream and stops now. It used to be ignored: the server waited out the stream. Then it
    waited up to 10 s for the engine thread, whose step may be building programs (a decode
    bucket's first step builds its sampler variants: ~10 s under load); ``long_step``: the
    step after the first token blocks until the test ends, as a long build would."""
    import asyncio

    from jaxinfer.llm import LLM
    from jaxinfer.serving.server import STOP_NOW_TIMEOUT_S, serve
    from tests.conftest import tiny_loaded
    from tests.serving.conftest import TINY_ARGS

    engine = LLM(tiny_loaded("llama"), **TINY_ARGS).engine
    step = type(engine).step
    got: dict[str, object] = {"tokens": 0}
    building = threading.Event()  # set: the "build" ends

    def slow_step():  # ~12 s for 120 tokens
        time.sleep(0.1)
        if long_step and got["tokens"]:
            building.wait(120)
        return step(engine)

    engine.step = slow_step

    def client(port: int) -> None:
        try:
            with InferenceClient(f"127.0.0.1:{port}", timeout=120) as c:
                for r in c.generate_stream(token_ids=[5, 6, 7], max_tokens=120,
                                           ignore_eos=True, temperature=0.0):
                    got["tokens"] += len(r.token_ids)
        except grpc.RpcError as e:
            got["error"] = e.code()

    async def run() -> tuple[int, float, object]:
        ready: asyncio.Future = asyncio.get_running_loop().create_future()
        task = asyncio.ensure_future(serve(engine, "127.0.0.1", 0, drain_timeout=60,
                                           warmup=False, ready=ready.set_result))
        server = await ready
        th = threading.Thread(target=client, args=(server.port,))
        th.start()
        while not got["tokens"]:
            await asyncio.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)  # drain: the stream would run ~12 s more
        await asyncio.sleep(0.5)
        t0 = time.monotonic()
        os.kill(os.getpid(), signal.SIGTERM)  # now
        rc = await asyncio.wait_for(task, 30)
        dt = time.monotonic() - t0
        await asyncio.get_running_loop().run_in_executor(None, th.join, 30)
        return rc, dt, server.engine_thread

    rc, dt, engine_thread = asyncio.run(run())
    try:
        assert rc == 0 and dt < 4 + STOP_NOW_TIMEOUT_S, dt
        assert got.get("error") is not None and 0 < got["tokens"] < 120, got
        if long_step:  # left behind while it "builds" (unless the 1 s were waited out)
            assert engine_thread.is_alive
    finally:
        building.set()
    engine_thread._thread.join(90)  # then it takes the stop request (after its step)
    assert not engine_thread.is_alive
