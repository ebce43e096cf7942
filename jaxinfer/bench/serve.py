"""``jaxinfer bench serve``: online serving benchmark against the gRPC server, with the knobs
of ``vllm bench serve`` (random dataset).

Requests: ``--num-prompts`` prompts of random token ids; input and output lengths drawn
uniformly from ``[L * (1 - r), L * (1 + r)]`` (``--random-input-len`` / ``--random-output-len``
L, ``--random-range-ratio`` r, as vLLM's random dataset); EOS ignored so every request
generates its drawn length. Arrivals: Poisson at ``--request-rate`` req/s (exponential gaps,
seeded) or all at once (``inf``); at most ``--max-concurrency`` in flight (a request's clock
starts when it is sent, after waiting for a slot, as in vLLM). Measured by the client per
stream message: TTFT, TPOT, ITL, end-to-end (``metrics.py``); errors are RPCs that did not
end OK.

The server: ``--host/--port`` of a running ``jaxinfer serve``, or, without ``--port``, one
started here as a subprocess on 127.0.0.1 with this command's engine options (its warm-up
runs before the benchmark; its Prometheus endpoint tells how many programs were compiled
during the measured run).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from jaxinfer.bench.cli import non_negative_float, positive_float
from jaxinfer.bench.driver import check_host_room
from jaxinfer.bench.metrics import Progress, RequestTimeline, format_table, summarize, unit_of
from jaxinfer.bench.records import check_out_dir, make_record, write_run


def add_parser(sub: Any, add_common: Any) -> None:
    """Register ``bench serve``; ``add_common`` adds the engine and output options."""
    p = sub.add_parser("serve", help="online serving: random requests against `jaxinfer serve`",
                       description=__doc__.splitlines()[0])
    add_common(p)
    p.add_argument("--host", default="127.0.0.1", help="server address (with --port)")
    p.add_argument("--port", type=int, default=None,
                   help="port of a running `jaxinfer serve`; without it a server is started "
                        "here with the engine options above")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="Prometheus port of that server (compile counts; optional)")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--random-input-len", type=int, default=128)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths uniform in [L*(1-r), L*(1+r)], r in [0, 1)")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests/s, Poisson arrivals (default inf: all at once)")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="most requests in flight (default: no limit)")
    p.add_argument("--num-warmups", type=int, default=0,
                   help="unmeasured requests of the same distribution sent first")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--request-timeout", type=positive_float, default=600.0,
                   help="per-request deadline")
    p.add_argument("--time-limit", type=non_negative_float, default=None,
                   help="seconds after which no new request is sent")
    p.add_argument("--start-timeout", type=positive_float, default=600.0,
                   help="seconds to wait for a started server to report SERVING")
    p.set_defaults(func=cmd_serve_bench)


# ------------------------------------------------------------------------------- workload
def sample_lengths(rng: np.random.Generator, n: int, length: int, range_ratio: float
                   ) -> np.ndarray:
    """``n`` lengths uniform on the integers of [floor(L(1-r)), ceil(L(1+r))], at least 1
    (vLLM's RandomDataset). Raises ValueError for L < 1 or r outside [0, 1)."""
    if length < 1:
        raise ValueError(f"random lengths must be >= 1, got {length}")
    if not 0 <= range_ratio < 1:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    lo = max(1, math.floor(length * (1 - range_ratio)))
    hi = max(lo, math.ceil(length * (1 + range_ratio)))
    return rng.integers(lo, hi + 1, size=n)


def arrival_gaps(rng: np.random.Generator, n: int, rate: float) -> np.ndarray:
    """Seconds to wait before each of ``n`` requests: exponential with mean 1/rate (a Poisson
    process), zeros for an infinite rate. Raises ValueError for a rate <= 0."""
    if not rate > 0:
        raise ValueError(f"--request-rate must be > 0 (or inf), got {rate}")
    if math.isinf(rate):
        return np.zeros(n)
    return rng.exponential(1.0 / rate, size=n)


# --------------------------------------------------------------------------------- server
@dataclass
class ServerProcess:
    """A ``jaxinfer serve`` subprocess on 127.0.0.1 (ports chosen by the server)."""

    proc: subprocess.Popen
    port: int
    metrics_port: int
    lines: list[str] = field(default_factory=list)

    def stop(self, timeout: float = 120.0) -> int:
        """SIGTERM (drain), then kill after ``timeout`` s; returns the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def engine_argv(ns: argparse.Namespace, actions: list[argparse.Action]) -> list[str]:
    """The engine options of ``ns`` that differ from their defaults, as command-line flags."""
    argv: list[str] = []
    for a in actions:
        v = getattr(ns, a.dest, None)
        if not a.option_strings or v is None or v == a.default or v is False:
            continue
        if v is True:
            argv.append(a.option_strings[0])
        else:
            argv += [a.option_strings[0], ",".join(map(str, v)) if isinstance(v, tuple)
                     else str(v)]
    return argv


def start_server(argv: list[str], start_timeout: float, env: dict[str, str] | None = None
                 ) -> ServerProcess:
    """Start ``jaxinfer serve <argv> --host 127.0.0.1 --port 0 --metrics-port 0`` (with
    environment ``env``, default this process's) and wait until it reports SERVING (after
    its warm-up). Raises RuntimeError with the server's last log lines if it exits or does
    not start in time."""
    env = dict(os.environ) if env is None else env
    cmd = [sys.executable, "-m", "jaxinfer.cli", "serve", *argv, "--host", "127.0.0.1",
           "--port", "0", "--metrics-port", "0"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env)
    lines: list[str] = []
    ports: list[int] = []

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)
            m = re.search(r"on 127\.0\.0\.1:(\d+), metrics on http://127\.0\.0\.1:(\d+)", line)
            if m:
                ports.extend((int(m.group(1)), int(m.group(2))))

    threading.Thread(target=read, daemon=True).start()
    t0 = time.monotonic()
    while not ports:
        if proc.poll() is not None or time.monotonic() - t0 > start_timeout:
            proc.kill()
            raise RuntimeError("jaxinfer serve did not start:\n" + "".join(lines[-30:]))
        time.sleep(0.1)
    return ServerProcess(proc, ports[0], ports[1], lines)


def scrape(host: str, metrics_port: int) -> dict[str, float]:
    """Samples of the server's Prometheus endpoint, {name: value} (labels dropped)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://{host}:{metrics_port}/metrics", timeout=10).read()
    return {s.name: s.value for fam in text_string_to_metric_families(text.decode())
            for s in fam.samples if not s.labels}


# --------------------------------------------------------------------------------- client
async def send_all(target: str, prompts: list[list[int]], output_lens: list[int],
                   gaps: np.ndarray, max_concurrency: int | None, temperature: float,
                   timeout: float, time_limit: float | None = None,
                   progress: Progress | None = None) -> tuple[list[RequestTimeline], float]:
    """Stream every request through ``Generate``; returns (timelines of the requests sent, in
    order, and seconds from the start to the last one's end). No request is sent once
    ``time_limit`` seconds have passed."""
    import grpc

    from jaxinfer.serving import jaxinfer_pb2_grpc as pb_grpc
    from jaxinfer.serving.client import build_request

    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    timelines: list[RequestTimeline | None] = [None] * len(prompts)
    t0 = time.perf_counter()

    async def one(i: int, stub: Any) -> None:
        if sem is not None:
            await sem.acquire()
        try:
            if time_limit is not None and time.perf_counter() - t0 > time_limit:
                return
            req = build_request(token_ids=prompts[i], max_tokens=int(output_lens[i]),
                                ignore_eos=True, temperature=temperature)
            tl = timelines[i] = RequestTimeline(time.perf_counter(), len(prompts[i]),
                                                int(output_lens[i]))
            try:
                async for r in stub.Generate(req, timeout=timeout):
                    if r.token_ids:
                        tl.add(time.perf_counter(), len(r.token_ids))
                tl.end = time.perf_counter()
            except grpc.aio.AioRpcError as e:
                tl.error = f"{e.code().name}: {e.details()}"
        finally:
            if sem is not None:
                sem.release()

    async with grpc.aio.insecure_channel(target) as ch:
        stub = pb_grpc.InferenceStub(ch)
        tasks = []
        for i, gap in enumerate(gaps):
            if gap > 0:
                await asyncio.sleep(float(gap))
            if time_limit is not None and time.perf_counter() - t0 > time_limit:
                break
            tasks.append(asyncio.create_task(one(i, stub)))
            if progress is not None:
                progress.tick(lambda: _status(timelines, t0))
        pending = set(tasks)
        while pending:
            _done, pending = await asyncio.wait(pending, timeout=1.0)
            if progress is not None:
                progress.tick(lambda: _status(timelines, t0))
    sent = [t for t in timelines if t is not None]
    end = max((t.end for t in sent if t.end is not None), default=time.perf_counter())
    return sent, max(end - t0, 1e-9)


def _status(timelines: list[RequestTimeline | None], t0: float) -> str:
    sent = [t for t in timelines if t is not None]
    done = sum(t.end is not None or t.error is not None for t in sent)
    toks = sum(t.output_len for t in sent)
    return (f"{len(sent)} sent, {done} done, {toks:,} output tokens, "
            f"{toks / max(time.perf_counter() - t0, 1e-9):,.1f} tok/s")


# ------------------------------------------------------------------------------------ run
def run_serve(ns: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark for parsed CLI options; returns ``{"summary", "config", "path"}``.

    Raises ValueError for bad options, RuntimeError when a started server fails to start.
    """
    from jaxinfer.serving.client import InferenceClient

    n = ns.num_prompts
    if n < 1 or ns.num_warmups < 0:
        raise ValueError("--num-prompts must be >= 1 and --num-warmups >= 0")
    if ns.max_concurrency is not None and ns.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {ns.max_concurrency}")
    # This process only sends requests; should anything here start JAX (the records'
    # device name does), it must not reserve the accelerator's memory the server needs.
    server_env = dict(os.environ)
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    check_out_dir(ns.out)
    rng = np.random.default_rng(ns.seed)
    total = n + ns.num_warmups
    check_host_room(total, ns.random_input_len + ns.random_output_len)
    in_lens = sample_lengths(rng, total, ns.random_input_len, ns.random_range_ratio)
    out_lens = sample_lengths(rng, total, ns.random_output_len, ns.random_range_ratio)
    gaps = arrival_gaps(rng, n, ns.request_rate)
    server = None
    if ns.port is None:
        if ns.max_num_seqs is None:
            ns.max_num_seqs = min(n, ns.max_concurrency or n, 256)
        need = int((in_lens + out_lens).max())
        if ns.max_model_len is None:
            ns.max_model_len = -(-need // ns.block_size) * ns.block_size
        elif need > ns.max_model_len:  # before seconds go into starting the server
            raise ValueError(f"the longest request needs {need} tokens (prompt + output); "
                             f"--max-model-len is {ns.max_model_len}")
        t0 = time.perf_counter()
        server = start_server(engine_argv(ns, ns.engine_actions), ns.start_timeout,
                              server_env)
        print(f"server started in {time.perf_counter() - t0:.1f} s on port {server.port}",
              file=sys.stderr, flush=True)
        host, port, mport = "127.0.0.1", server.port, server.metrics_port
    else:
        host, port, mport = ns.host, ns.port, ns.metrics_port
    target = f"{host}:{port}"
    import grpc

    try:
        with InferenceClient(target, timeout=60) as c:
            try:
                info = c.model_info()
            except grpc.RpcError as e:  # nothing listening, or not our server
                raise ValueError(f"no jaxinfer server answers at {target}: "
                                 f"{e.code().name}: {e.details()}") from None
        need = int((in_lens + out_lens).max())
        if need > info.max_model_len:
            raise ValueError(f"the longest request needs {need} tokens (prompt + output); the "
                             f"server's max_model_len is {info.max_model_len}")
        prompts = [rng.integers(0, info.vocab_size, int(m)).tolist() for m in in_lens]
        if ns.num_warmups:
            w, _ = asyncio.run(send_all(target, prompts[n:], list(out_lens[n:]),
                                        np.zeros(ns.num_warmups), ns.max_concurrency,
                                        ns.temperature, ns.request_timeout))
            print(f"warm-up: {ns.num_warmups} requests, {sum(t.error is not None for t in w)} "
                  f"errors", file=sys.stderr, flush=True)
        before = scrape(host, mport) if mport else {}
        timelines, duration = asyncio.run(send_all(
            target, prompts[:n], list(out_lens[:n]), gaps, ns.max_concurrency, ns.temperature,
            ns.request_timeout, ns.time_limit, Progress("serve", ns.progress_interval)))
        after = scrape(host, mport) if mport else {}
    finally:
        rc = server.stop() if server is not None else None
    s = summarize(timelines, duration)
    s["not_sent"] = n - len(timelines)
    if mport:
        for key in ("jaxinfer_num_compilations", "jaxinfer_num_programs_loaded"):
            s[key.removeprefix("jaxinfer_num_") + "_during_run"] = \
                after.get(key, 0) - before.get(key, 0)
    if rc is not None:
        s["server_exit_code"] = rc
    s["loadavg_1min"] = os.getloadavg()[0]  # the client shares the machine with the server
    config = {"model": info.model, "dtype": info.dtype, "max_num_seqs": info.max_num_seqs,
              "max_model_len": info.max_model_len, "kv_pages": info.num_kv_pages,
              "max_num_batched_tokens": info.max_num_batched_tokens,
              "server": "started here" if server is not None else target,
              "transport": "gRPC streaming", "num_prompts": n,
              "random_input_len": ns.random_input_len,
              "random_output_len": ns.random_output_len,
              "random_range_ratio": ns.random_range_ratio, "request_rate": ns.request_rate,
              "max_concurrency": ns.max_concurrency, "num_warmups": ns.num_warmups,
              "temperature": ns.temperature, "seed": ns.seed, "time_limit_s": ns.time_limit}
    config["request_rate"] = "inf" if math.isinf(ns.request_rate) else ns.request_rate
    records = [make_record(f"bench_serve.{k}", v, unit_of(k), config) for k, v in s.items()]
    path = write_run(f"bench_serve-{info.model}", records, ns.out)
    print(f"records: {path}", file=sys.stderr, flush=True)
    print(format_table(summary_rows(s), f"bench serve: {info.model}, {n} requests"))
    return {"summary": s, "config": config, "path": path}


def summary_rows(s: dict[str, Any]) -> list[tuple[str, Any]]:
    """The rows of the printed summary (vLLM's layout)."""
    rows: list[tuple[str, Any]] = [
        ("successful requests", s["completed"]),
        ("failed requests (errors)", s["errors"]),
        ("not sent (time limit)", s["not_sent"]),
        ("length mismatches", s["length_mismatches"]),
        ("benchmark duration (s)", s["duration_s"]),
        ("total input tokens", s["input_tokens"]),
        ("total generated tokens", s["output_tokens"]),
        ("request throughput (req/s)", s["request_throughput"]),
        ("output token throughput (tok/s)", s["output_throughput"]),
        ("total token throughput (tok/s)", s["total_token_throughput"]),
    ]
    for m, name in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2e", "E2E")):
        rows.append((f"{name} mean / p50 / p90 / p99 (ms)",
                     " / ".join(f"{s[f'{m}_ms_{k}']:.4g}" for k in ("mean", "p50", "p90", "p99"))))
    if "compilations_during_run" in s:
        c, lo = s["compilations_during_run"], s["programs_loaded_during_run"]
        rows.append(("programs compiled / loaded during run", f"{c:g} / {lo:g}"))
    return rows


def cmd_serve_bench(ns: argparse.Namespace) -> int:
    s = run_serve(ns)["summary"]
    ok = s["errors"] == 0 and s["length_mismatches"] == 0 and s.get("server_exit_code", 0) == 0
    return 0 if ok else 1
