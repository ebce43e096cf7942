#!/usr/bin/env bash
# Set up, then run the main job on the default embedded model (SmolLM2-135M-Instruct).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/jaxinfer generate --chat "What is 2+2?" "$@"
