"""Importing jaxinfer keeps transformers' "PyTorch was not found" advisory off stderr."""

import importlib.util
import subprocess
import sys

import pytest


@pytest.mark.skipif(importlib.util.find_spec("torch") is not None,
                    reason="transformers only announces a missing torch")
def test_api_import_does_not_print_transformers_torch_advice():
    """transformers logs "PyTorch was not found ..." at import when torch is absent (CI and
    the laptop set-up have no torch); a research user importing jaxinfer should not see it.
    Without the switch in jaxinfer/__init__.py the line is on stderr."""
    code = "import jaxinfer, transformers; print('ok')"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"
    assert "PyTorch was not found" not in r.stderr, r.stderr
    # the user's own choice wins
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={"TRANSFORMERS_NO_ADVISORY_WARNINGS": "", "PATH": ""})
    assert "PyTorch was not found" in r.stderr, r.stderr
