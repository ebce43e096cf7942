"""pytest plugin for GPU runs of engine tests written for the CPU (scripts/gpu_call_s36_d.sh).

An engine sized from device memory takes ``gpu_memory_utilization`` of what the device has
left for its KV pool, so the second engine a test builds finds no room (ConfigError, seen on
an H100 in session 36). This plugin makes each engine see ~256 MiB free beyond what is in use.
Use: ``PYTHONPATH=.:scripts python3 -m pytest -p pytest_small_pools ...``.
"""

from jaxinfer import kv_sizing

_real = kv_sizing.device_memory_stats


def _small_room():
    stats = _real()
    if stats is not None:
        in_use = int(stats.get("bytes_in_use", 0))
        stats = {**stats, "bytes_limit": int((in_use + (256 << 20)) / 0.9) + 1}
    return stats


kv_sizing.device_memory_stats = _small_room
