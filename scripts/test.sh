#!/usr/bin/env bash
# Set up, then run the whole test suite on the CPU (what CI runs). Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export JAX_PLATFORMS=cpu
exec .venv/bin/python -m pytest -q "$@"
