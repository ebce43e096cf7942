"""Loopback load test of `jaxinfer serve`: N streaming requests, bounded count and time.

    .venv/bin/python benchmarks/serve_load.py [--model smollm2-135m] [--num-requests 500]
        [--concurrency 64] [--max-tokens 16] [--time-limit 900]

Starts the server as a subprocess on 127.0.0.1 (a free port; nothing leaves the machine),
waits for health SERVING, sends `--warmup-requests` requests (not measured: they compile the
prefill shapes the load needs), then `--num-requests` chat requests from `--concurrency`
closed-loop workers (each sends its next request when the previous one ends), greedy with a
fixed output length (ignore_eos) so runs are comparable. No new request starts after
`--time-limit` seconds. Client-side measures: TTFT (request sent -> first token message),
ITL (gaps between token messages of a stream), end-to-end, output tok/s over the measured
wall time, and errors (any non-OK status). Programs compiled during the measured run are read
from the server's Prometheus endpoint. One JSON record per number goes to
benchmarks/results/ (benchmarks/common.py); a summary prints as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.common import record

TOPICS = ["the ocean", "volcanoes", "honey bees", "the moon", "chess", "bread", "rainbows",
          "glaciers", "owls", "electricity", "the Roman empire", "coffee", "deserts", "comets",
          "bicycles", "music", "clouds", "penguins", "the printing press", "trees"]
ASKS = ["Tell me one fact about {}.", "Why is {} interesting?", "Describe {} in one sentence.",
        "What should a child know about {}?", "Write a short poem about {}.",
        "Give me a fun question about {}.", "How would you explain {} to a friend?",
        "What is the history of {}?", "List two words related to {}.",
        "What is surprising about {}?", "Summarize what you know about {}.",
        "Is {} important? Answer briefly.", "Compare {} with something familiar.",
        "What colour do you associate with {}?", "Make up a title for a book on {}.",
        "What is a common myth about {}?", "Start a story about {}.",
        "What would a scientist study about {}?", "Say something kind about {}.",
        "Ask me a question about {}.", "What is the best thing about {}?",
        "How does {} change over time?", "Name a place known for {}.",
        "What does {} sound like?", "Explain {} in simple words."]


def prompts(n: int) -> list[str]:
    """``n`` distinct user messages (topic x phrasing), deterministic."""
    return [ASKS[(i // len(TOPICS)) % len(ASKS)].format(TOPICS[i % len(TOPICS)])
            for i in range(n)]


def start_server(a: argparse.Namespace) -> tuple[subprocess.Popen, int, int, list[str]]:
    env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"),
               JAX_COMPILATION_CACHE_DIR=str(ROOT / ".cache" / "jax-bench-compilation-cache"),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    cmd = [sys.executable, "-m", "jaxinfer.cli", "serve", "--model", a.model, "--host",
           "127.0.0.1", "--port", "0", "--metrics-port", "0", "--max-num-seqs",
           str(a.max_num_seqs), "--max-model-len", str(a.max_model_len),
           "--max-num-batched-tokens", str(a.max_num_batched_tokens)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
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
        if proc.poll() is not None or time.monotonic() - t0 > a.start_timeout:
            proc.kill()
            raise SystemExit("server did not start:\n" + "".join(lines[-30:]))
        time.sleep(0.2)
    return proc, ports[0], ports[1], lines


def scrape(metrics_port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics",
                                  timeout=10).read().decode()
    return {ln.split(" ")[0]: float(ln.split(" ")[1]) for ln in text.splitlines()
            if ln and not ln.startswith("#")}


async def load(port: int, msgs: list[str], a: argparse.Namespace, deadline: float | None
               ) -> list[dict]:
    import grpc

    from jaxinfer.serving import jaxinfer_pb2_grpc as pb_grpc
    from jaxinfer.serving.client import build_request

    results: list[dict] = []
    queue = list(enumerate(msgs))[::-1]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = pb_grpc.InferenceStub(ch)

        async def worker() -> None:
            while queue and (deadline is None or time.monotonic() < deadline):
                i, msg = queue.pop()
                req = build_request(messages=[{"role": "user", "content": msg}],
                                    temperature=0.0, max_tokens=a.max_tokens, ignore_eos=True)
                t0 = time.perf_counter()
                times, ntok, err = [], 0, None
                try:
                    async for r in stub.Generate(req, timeout=a.request_timeout):
                        if r.token_ids:
                            times.append(time.perf_counter())
                            ntok += len(r.token_ids)
                except grpc.aio.AioRpcError as e:
                    err = f"{e.code().name}: {e.details()}"
                results.append({"i": i, "t0": t0, "times": times, "tokens": ntok, "error": err,
                                "end": time.perf_counter()})

        await asyncio.gather(*(worker() for _ in range(a.concurrency)))
    return results


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else float("nan")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--num-requests", type=int, default=500)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--max-num-batched-tokens", type=int, default=256)
    p.add_argument("--warmup-requests", type=int, default=64)
    p.add_argument("--time-limit", type=float, default=900.0,
                   help="seconds after which no new measured request starts")
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--no-record", action="store_true")
    a = p.parse_args()
    if not 1 <= a.num_requests <= 5000 or not 1 <= a.concurrency <= 1024:
        raise SystemExit("--num-requests must be in [1, 5000], --concurrency in [1, 1024]")

    load_before = os.getloadavg()[0]  # the 2 cores may be shared with other jobs
    t_start = time.perf_counter()
    proc, port, mport, _lines = start_server(a)
    try:
        startup = time.perf_counter() - t_start
        msgs = prompts(a.num_requests + a.warmup_requests)
        tw = time.perf_counter()
        warm = asyncio.run(load(port, msgs[a.num_requests:], a, None))
        warmup_s = time.perf_counter() - tw
        before = scrape(mport)
        t0 = time.perf_counter()
        res = asyncio.run(load(port, msgs[:a.num_requests], a, time.monotonic() + a.time_limit))
        wall = time.perf_counter() - t0
        after = scrape(mport)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = -9
    ok = [r for r in res if r["error"] is None]
    ttft = [r["times"][0] - r["t0"] for r in ok if r["times"]]
    itl = [b - a_ for r in ok for a_, b in zip(r["times"], r["times"][1:])]
    e2e = [r["end"] - r["t0"] for r in ok]
    out_tokens = sum(r["tokens"] for r in ok)
    errors = len(res) - len(ok) + sum(1 for r in warm if r["error"] is not None)
    key = "jaxinfer_num_compilations"
    summary = {
        "model": a.model, "requests_sent": len(res), "requests_ok": len(ok), "errors": errors,
        "error_examples": sorted({r["error"] for r in res if r["error"]})[:3],
        "wall_s": wall, "output_tokens": out_tokens, "output_tok_per_s": out_tokens / wall,
        "requests_per_s": len(ok) / wall,
        "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99),
        "itl_p50_s": pct(itl, 50), "itl_p99_s": pct(itl, 99),
        "e2e_p50_s": pct(e2e, 50), "e2e_p99_s": pct(e2e, 99),
        "compilations_during_run": after.get(key, 0) - before.get(key, 0),
        "compilations_total": after.get(key, 0),
        "programs_loaded_during_run": (after.get("jaxinfer_num_programs_loaded", 0)
                                       - before.get("jaxinfer_num_programs_loaded", 0)),
        "startup_s": startup, "warmup_s": warmup_s,
        "server_exit_code": rc,
        "loadavg_1min_before_after": [load_before, os.getloadavg()[0]],
    }
    config = {k: getattr(a, k) for k in ("model", "num_requests", "concurrency", "max_tokens",
                                          "max_num_seqs", "max_model_len",
                                          "max_num_batched_tokens", "warmup_requests",
                                          "time_limit")}
    config.update(transport="grpc loopback 127.0.0.1", prompts="chat, 500 distinct user "
                  "messages", sampling="greedy, ignore_eos", requests_ok=len(ok),
                  errors=errors, wall_s=round(wall, 2),
                  compilations_during_run=summary["compilations_during_run"],
                  programs_loaded_during_run=summary["programs_loaded_during_run"],
                  loadavg_1min_before_after=summary["loadavg_1min_before_after"])
    if not a.no_record:
        for name, unit in (("output_tok_per_s", "tok/s"), ("requests_per_s", "req/s"),
                           ("ttft_p50_s", "s"), ("ttft_p99_s", "s"), ("itl_p50_s", "s"),
                           ("itl_p99_s", "s"), ("e2e_p50_s", "s"), ("e2e_p99_s", "s"),
                           ("errors", "count")):
            record(f"serve_load-{a.model}-{name}", summary[name], unit, config)
    print(json.dumps(summary, indent=1))
    return 0 if errors == 0 and rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
