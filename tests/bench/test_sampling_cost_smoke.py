"""Smoke test of ``benchmarks/sampling_cost.py --smoke`` (CPU): it runs, times the sampler
variant each mix gets (the program the runner runs), and those programs have no sort and no
conditional. No timing is asserted."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_sampling_cost_smoke_times_the_variants():
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "benchmarks/sampling_cost.py", "--smoke",
                          "--modes", "variant", "--mixes", "greedy", "penalties", "top_p",
                          "logprobs"], capture_output=True, text=True, env=env, cwd=ROOT,
                         timeout=600, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [ln.split() for ln in out.stdout.splitlines() if ln.startswith("variant ")]
    got = {(r[1], r[2], int(r[3])): r[8] for r in rows}  # (mix, variant, B) -> sort/cond
    assert got == {(mix, variant, B): "0/0" for mix, variant in [
        ("greedy", "greedy"), ("penalties", "temperature"), ("top_p", "top_p"),
        ("logprobs", "logprobs")] for B in (1, 8)}
