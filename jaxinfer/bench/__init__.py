"""Benchmark harness: ``jaxinfer bench offline | serve | latency | roofline``.

* :mod:`.offline` -- throughput of N fixed-length requests submitted at once;
* :mod:`.serve` -- online serving against the gRPC server (``vllm bench serve``'s knobs);
* :mod:`.latency` -- TTFT per prompt length, TPOT and tok/s per concurrency, roofline;
* :mod:`.roofline` -- bytes and FLOPs of a decode step from a ModelConfig;
* :mod:`.metrics` -- request timelines, percentiles, summaries; :mod:`.records` -- JSON
  result records; :mod:`.driver` -- the engine-side loop of offline and latency.
"""
