"""``jaxinfer convert`` checks that its output can be created before it reads the model: an
output under /proc (or any folder that takes no new entry) used to fail only after the
model was loaded, with an error naming a temporary directory."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_loading import hf_weights, write_tiny_gguf  # noqa: E402

from jaxinfer import loading  # noqa: E402,I001

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "tiny" / "llama"
UNWRITABLE = "/proc/jaxinfer-no-such-dir"  # /proc takes no new directory, even for root


def _no_load(monkeypatch):
    def fail(*_a, **_k):
        raise AssertionError("the model was read before the output was checked")

    monkeypatch.setattr(loading, "load_hf", fail)
    monkeypatch.setattr(loading, "_load_gguf", fail)


def test_unwritable_output_fails_before_loading_naming_it(monkeypatch, capsys):
    from jaxinfer.cli import main

    _no_load(monkeypatch)
    out = f"{UNWRITABLE}/out"
    assert main(["convert", "--model", str(FIXTURE), "--output", out]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"jaxinfer: error: output {out}: cannot create it in /proc (No such file or "
        f"directory)"]


def test_unwritable_checkpoint_cache_fails_before_loading(tmp_path, monkeypatch):
    src = write_tiny_gguf(tmp_path / "t.gguf", hf_weights())
    monkeypatch.setenv("JAXINFER_CHECKPOINT_DIR", UNWRITABLE)
    _no_load(monkeypatch)
    with pytest.raises(loading.CheckpointError, match=(
            rf"the checkpoint cache entry {UNWRITABLE}/converted/t-\w+: cannot create it in "
            r"/proc \(No such file or directory\); set \$JAXINFER_CHECKPOINT_DIR")):
        loading.convert(str(src))


def test_writable_output_with_new_parents_still_converts(tmp_path):
    out = tmp_path / "new" / "parents" / "out"
    assert loading.convert(str(FIXTURE), str(out), progress=False) == out
    assert (out / "manifest.json").is_file()
    assert not [p for p in tmp_path.rglob(".jaxinfer-probe-*")]


@pytest.mark.parametrize("out", ["", "  "])
def test_empty_output_is_refused_naming_it(out, monkeypatch, capsys):
    """``--output ""`` used to say ". already exists" (Path("") is the working directory)."""
    from jaxinfer.cli import main

    _no_load(monkeypatch)
    assert main(["convert", "--model", str(FIXTURE), "--output", out]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"jaxinfer: error: output must name a new directory, got {out!r}"]
