"""Does one oversized prompt hold up a `jaxinfer serve`? (CPU or GPU)

Starts ``jaxinfer serve`` from a source tree (``--tree``: this checkout by default, or an
older one to compare), runs a greedy stream of ``--stream-tokens`` tokens, and while it runs
sends one GenerateUnary whose text prompt has ``size`` characters (``"hello "`` repeated),
then a health check. Per size: how long the big request took and with which status, how long
the health check waited, and the running stream's largest gap between two messages (its
first excluded). Records ``serving_big_prompt_*`` (one JSON list a run) under ``--out``.

  .venv/bin/python benchmarks/serving_big_prompt.py --model smollm2-135m --sizes 6000000
  .venv/bin/python benchmarks/serving_big_prompt.py --tree /tmp/old --label before ...
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402

from jaxinfer.bench.records import make_record, write_run  # noqa: E402
from jaxinfer.serving import jaxinfer_pb2 as pb  # noqa: E402
from jaxinfer.serving import jaxinfer_pb2_grpc as pb_grpc  # noqa: E402


def start_server(tree: Path, model: str) -> tuple[subprocess.Popen, str]:
    env = dict(os.environ, PYTHONPATH=str(tree), JAX_PLATFORMS=os.environ.get(
        "JAX_PLATFORMS", "cpu"))
    proc = subprocess.Popen([sys.executable, "-m", "jaxinfer.cli", "serve", "--model", model,
                             "--port", "0"], cwd=tree, env=env, stderr=subprocess.PIPE,
                            text=True)
    assert proc.stderr is not None
    for line in proc.stderr:
        if m := re.search(r"serving \S+ on (\S+:\d+)", line):
            threading.Thread(target=proc.stderr.read, daemon=True).start()  # drain
            return proc, m.group(1)
    raise RuntimeError(f"server exited ({proc.wait()}) before serving")


def probe(target: str, size: int, stream_tokens: int) -> dict:
    opts = [("grpc.max_send_message_length", 200 * 2**20)]
    with grpc.insecure_channel(target, options=opts) as ch:
        stub, health = pb_grpc.InferenceStub(ch), health_pb2_grpc.HealthStub(ch)
        gaps: list[float] = []

        def stream() -> None:
            last = time.monotonic()
            req = pb.GenerateRequest(prompt="Tell me a long story.", sampling=pb.SamplingParameters(
                max_tokens=stream_tokens, ignore_eos=True, temperature=0.0))
            for _ in stub.Generate(req, timeout=600):
                now = time.monotonic()
                gaps.append(now - last)
                last = now

        out: dict = {}

        def big() -> None:
            t0 = time.monotonic()
            try:
                stub.GenerateUnary(pb.GenerateRequest(prompt="hello " * (size // 6)), timeout=120)
                out["status"] = "OK"
            except grpc.RpcError as e:
                out["status"] = e.code().name
            out["big_s"] = time.monotonic() - t0

        ts = threading.Thread(target=stream)
        ts.start()
        time.sleep(2.0)
        tb = threading.Thread(target=big)
        tb.start()
        time.sleep(0.3)
        t0 = time.monotonic()
        health.Check(health_pb2.HealthCheckRequest(), timeout=120)
        out["health_s"] = time.monotonic() - t0
        tb.join()
        ts.join()
        out["stream_max_gap_s"] = max(gaps[1:])
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tree", type=Path, default=ROOT, help="source tree the server runs")
    ap.add_argument("--label", default="current")
    ap.add_argument("--sizes", default="6000000", help="prompt characters, comma-separated")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--stream-tokens", type=int, default=300)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args()
    proc, target = start_server(args.tree.resolve(), args.model)
    records = []
    try:
        for size in (int(s) for s in args.sizes.split(",")):
            for rep in range(args.repeats):
                r = probe(target, size, args.stream_tokens)
                print(f"{args.label} {size / 1e6:g}M chars run {rep}: {r['status']} after "
                      f"{r['big_s']:.2f} s, health {r['health_s']:.2f} s, stream max gap "
                      f"{r['stream_max_gap_s']:.2f} s", flush=True)
                cfg = {"label": args.label, "model": args.model, "prompt_chars": size,
                       "repeat": rep, "status": r["status"], "tree": str(args.tree)}
                records += [make_record(f"serving_big_prompt_{k}", r[k], "s", cfg)
                            for k in ("big_s", "health_s", "stream_max_gap_s")]
    finally:
        proc.terminate()
        proc.wait(60)
    print(write_run(f"serving_big_prompt-{args.label}", records, args.out))


if __name__ == "__main__":
    main()
