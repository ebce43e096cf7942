"""``jaxinfer serve`` as a subprocess: SIGTERM stops accepting, drains in-flight streams, exits 0."""

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
