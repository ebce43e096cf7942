#!/usr/bin/env bash
# Set up, then run the whole test suite on the CPU (what CI runs). Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export JAX_PLATFORMS=cpu
# Two pytest-xdist workers (a 2-core CI box: 1,967 s -> 1,350 s measured); --dist loadscope
# keeps each module on one worker, so module-scoped fixtures are built once and the modules
# that convert a real model into checkpoints/ never race on it. JAXINFER_TEST_WORKERS=0 runs
# in-process (pdb, -s); extra args go after ours, so "-n N" there wins too.
# --durations: the 30 slowest tests at the end of the log, for the next trim (~30 min budget).
# --max-worker-restart=0: a crashed worker (an XLA:CPU segfault, seen twice: sessions 41 and
# 46) fails its test and the run ends; with restarts, loadscope re-queues the dead worker's
# finished modules as empty work and the run deadlocks at its end (pytest-xdist 3.8.0, issue
# #1378; session 46's clean-clone run hung there until killed).
exec .venv/bin/python -m pytest -q -n "${JAXINFER_TEST_WORKERS:-2}" --dist loadscope \
  --durations=30 --max-worker-restart=0 "$@"
