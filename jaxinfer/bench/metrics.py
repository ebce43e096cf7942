"""Request timelines and their summary statistics (names and definitions as ``vllm bench``).

Per request, on one ``time.perf_counter()`` clock:

* TTFT = first token arrival - submission;
* TPOT = (end - first token) / (output tokens - 1), the mean gap after the first token
  (requests with one output token have none);
* ITL = every gap between consecutive token arrivals (a message carrying k > 1 tokens counts
  as one arrival, as vLLM counts stream chunks);
* end-to-end latency (E2E) = end - submission.

Percentiles are numpy's (linear interpolation). Throughputs are over the measured duration.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclass
class RequestTimeline:
    """What a client saw of one request.

    Attributes:
      start: submission time (s).
      prompt_len: prompt tokens.  expected_output_len: the ``max_tokens`` asked for.
      arrivals: times (s) at which new tokens arrived, one per step / stream message.
      tokens: how many tokens arrived at each of ``arrivals``.
      end: time the request finished (None while unfinished or aborted).
      error: why it failed (None when it did not).
    """

    start: float
    prompt_len: int
    expected_output_len: int
    arrivals: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    end: float | None = None
    error: str | None = None

    def add(self, t: float, n: int) -> None:
        """``n`` > 0 new tokens arrived at time ``t``."""
        self.arrivals.append(t)
        self.tokens.append(n)

    @property
    def output_len(self) -> int:
        return sum(self.tokens)

    @property
    def finished(self) -> bool:
        """Ended without an error (its token count is checked separately)."""
        return self.end is not None and self.error is None

    @property
    def ttft(self) -> float | None:
        return self.arrivals[0] - self.start if self.arrivals else None

    @property
    def tpot(self) -> float | None:
        n = self.output_len
        if self.end is None or not self.arrivals or n < 2:
            return None
        return (self.arrivals[-1] - self.arrivals[0]) / (n - 1)

    @property
    def itls(self) -> list[float]:
        return np.diff(self.arrivals).tolist() if len(self.arrivals) > 1 else []

    @property
    def e2e(self) -> float | None:
        return self.end - self.start if self.end is not None else None


def percentiles(values: Iterable[float], qs: Iterable[int] = PERCENTILES) -> dict[str, float]:
    """``{"mean", "p50", "p90", "p99"}`` of ``values`` (NaN for each when empty)."""
    x = np.asarray(list(values), dtype=np.float64)
    qs = tuple(qs)
    if x.size == 0:
        return {"mean": float("nan"), **{f"p{q}": float("nan") for q in qs}}
    out = {"mean": float(x.mean())}
    out.update({f"p{q}": float(v) for q, v in zip(qs, np.percentile(x, qs))})
    return out


def summarize(timelines: list[RequestTimeline], duration_s: float) -> dict[str, Any]:
    """Counts, throughputs and latency percentiles of a run.

    Args:
      timelines: every request submitted in the measured run.
      duration_s: measured wall time (first submission to last finish or the time limit).
    Returns:
      A flat dict: ``num_requests``, ``completed`` (finished, no error), ``errors``,
      ``unfinished`` (aborted at a time limit or still running), ``length_mismatches``
      (completed with an output length other than asked), ``input_tokens`` (prompts that
      produced a first token, i.e. were prefilled), ``output_tokens`` (all tokens received,
      unfinished requests' included), ``request_throughput`` (completed req/s),
      ``output_throughput`` and ``total_token_throughput`` (tok/s), and for ttft, tpot, itl,
      e2e: ``<m>_ms_{mean,p50,p90,p99}``.
    Raises:
      ValueError: ``duration_s`` is not positive.
    """
    if not duration_s > 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s!r}")
    done = [t for t in timelines if t.finished]
    out_tokens = sum(t.output_len for t in timelines)
    in_tokens = sum(t.prompt_len for t in timelines if t.arrivals)
    s: dict[str, Any] = {
        "num_requests": len(timelines),
        "completed": len(done),
        "errors": sum(t.error is not None for t in timelines),
        "unfinished": sum(t.end is None and t.error is None for t in timelines),
        "length_mismatches": sum(t.output_len != t.expected_output_len for t in done),
        "duration_s": duration_s,
        "input_tokens": in_tokens,
        "output_tokens": out_tokens,
        "request_throughput": len(done) / duration_s,
        "output_throughput": out_tokens / duration_s,
        "total_token_throughput": (in_tokens + out_tokens) / duration_s,
    }
    series: dict[str, list[float | None]] = {
        "ttft": [t.ttft for t in done], "tpot": [t.tpot for t in done],
        "itl": [g for t in done for g in t.itls], "e2e": [t.e2e for t in done]}
    for name, vals in series.items():
        for k, v in percentiles(1000.0 * x for x in vals if x is not None).items():
            s[f"{name}_ms_{k}"] = v
    return s


def unit_of(key: str) -> str:
    """The unit of a summary key (for records): ms, s, req/s, tok/s, bytes, fraction, load
    or count."""
    if key.startswith("loadavg"):
        return "load"
    if "_ms_" in key:
        return "ms"
    if key.endswith("_s"):
        return "s"
    if key == "request_throughput":
        return "req/s"
    if key.endswith("_throughput"):
        return "tok/s"
    if key.endswith("_bytes"):
        return "bytes"
    if key.endswith("_frac"):
        return "fraction"
    return "count"


def format_table(rows: list[tuple[str, Any]], title: str = "") -> str:
    """Two aligned columns: name, value (floats to 4 significant digits, big ints grouped;
    None -- a figure the platform does not report, e.g. device memory on the CPU -- as n/a)."""
    def fmt(v: Any) -> str:
        if v is None:
            return "n/a"
        if isinstance(v, bool):
            return str(v)
        if isinstance(v, int):
            return f"{v:,}"
        if isinstance(v, float):
            if math.isnan(v):
                return "n/a"
            return f"{v:,.1f}" if abs(v) >= 1000 else f"{v:.4g}"
        return str(v)

    width = max((len(k) for k, _ in rows), default=0)
    lines = [f"== {title} =="] if title else []
    lines += [f"{k:<{width}}  {fmt(v)}" for k, v in rows]
    return "\n".join(lines)


class Progress:
    """Prints one status line to stderr at most every ``interval_s`` seconds."""

    def __init__(self, label: str, interval_s: float = 10.0) -> None:
        self.label = label
        self.interval_s = interval_s
        self.t0 = time.perf_counter()
        self._last = self.t0

    def tick(self, text_fn: Any, force: bool = False) -> None:
        """Print ``text_fn()`` (called only when a line is due) after the elapsed time."""
        now = time.perf_counter()
        if force or now - self._last >= self.interval_s:
            self._last = now
            print(f"[{self.label} {now - self.t0:7.1f} s] {text_fn()}", file=sys.stderr,
                  flush=True)
