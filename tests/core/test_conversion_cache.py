"""The conversion cache repairs itself: a damaged or stale copy (a file missing or cut short,
tokenizer.json gone, a malformed or edited manifest) is re-made from its source by the next
load and by ``jaxinfer convert``; a copy given by path fails with one error naming it and the
repair, without tensorstore's "Event loop is closed" tracebacks."""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_loading import _tiny_tokenizer, hf_weights, write_tiny_gguf  # noqa: E402

from jaxinfer.loading import CheckpointError, LoadedModel, convert, load_model, orbax_store  # noqa: E402,I001


@pytest.fixture(autouse=True)
def _ckpt_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    d = tmp_path / "ckpt"
    monkeypatch.setenv("JAXINFER_CHECKPOINT_DIR", str(d))
    return d


@pytest.fixture
def cached(tmp_path: Path) -> tuple[Path, Path, LoadedModel]:
    """(GGUF source, its cache entry, the model loaded from the source)."""
    src = write_tiny_gguf(tmp_path / "c.gguf", hf_weights())
    first = load_model(str(src), progress=False)
    entry = orbax_store.find_cached(src)
    assert entry is not None
    return src, entry, first


def _biggest(d: Path) -> Path:
    return max((p for p in (d / "params").rglob("*") if p.is_file()),
               key=lambda p: p.stat().st_size)


def _same(a: LoadedModel, b: LoadedModel) -> None:
    for k, v in a.params.items():
        np.testing.assert_array_equal(b.params[k], v)


def test_damaged_copy_by_path_is_one_error_naming_it_and_the_repair(cached, capfd) -> None:
    _, entry, _ = cached
    (entry / "params" / "manifest.ocdbt").unlink()
    with pytest.raises(CheckpointError) as e:
        load_model(str(entry), progress=False)
    msg = str(e.value)
    assert str(entry) in msg and "damaged" in msg and "manifest.ocdbt" in msg
    assert f"delete {entry}" in msg and "jaxinfer convert --model" in msg
    time.sleep(0.3)  # tensorstore's threads printed their tracebacks after the error
    assert "Event loop is closed" not in capfd.readouterr().err


def test_damaged_copy_outside_the_cache_is_not_promised_a_remake(cached, tmp_path) -> None:
    """A GGUF's converted copy at the user's own path: the next load does not re-make it
    (only the cache's copies are), so the hint is the convert command with --output."""
    src, entry, _ = cached
    mine = tmp_path / "mine"
    shutil.copytree(entry, mine)
    (mine / "params" / "manifest.ocdbt").unlink()
    with pytest.raises(CheckpointError) as e:
        load_model(str(mine), progress=False)
    msg = str(e.value)
    assert f"delete {mine} and run `jaxinfer convert --model {src} --output {mine}`" in msg
    assert "re-makes" not in msg


def test_failed_restore_leaves_no_event_loop_tracebacks(cached, capfd) -> None:
    """Damage the cheap checks do not see (an older manifest lists no files, so a missing
    tree metadata file passes them): orbax's restore fails with reads in flight."""
    _, entry, _ = cached
    m = json.loads((entry / "manifest.json").read_text())
    del m["files"]
    (entry / "manifest.json").write_text(json.dumps(m))
    (entry / "params" / "manifest.ocdbt").unlink()
    import orbax.checkpoint as ocp

    from jaxinfer.loading.orbax_teardown import orbax_loops

    with pytest.raises(Exception, match="NOT_FOUND"):
        with orbax_loops(), ocp.PyTreeCheckpointer() as ckptr:
            ckptr.restore(entry / "params")
    time.sleep(0.3)
    assert "Event loop is closed" not in capfd.readouterr().err


@pytest.mark.parametrize("damage", ["truncate", "delete", "tokenizer"])
def test_load_and_convert_remake_a_damaged_cache_copy(cached, damage, capfd) -> None:
    src, entry, first = cached
    if damage == "tokenizer":  # a copy whose tokenizer.json is gone is damaged (D7)
        tok = _tiny_tokenizer("{{ messages[0]['content'] }}")
        shutil.rmtree(entry)
        orbax_store.save_converted(entry, LoadedModel(first.config, first.params, tok, "x"),
                                   source=src)
        assert load_model(str(entry)).tokenizer is not None
        (entry / "tokenizer.json").unlink()
        with pytest.raises(CheckpointError, match=r"damaged: tokenizer.json is missing"):
            load_model(str(entry))
    elif damage == "truncate":
        big = _biggest(entry)
        big.write_bytes(big.read_bytes()[:1000])
    else:
        _biggest(entry).unlink()
    assert orbax_store.find_cached(src) is None
    capfd.readouterr()
    again = load_model(str(src), progress=False)
    assert "is damaged" in capfd.readouterr().err
    _same(first, again)
    assert orbax_store.find_cached(src) == entry
    assert [p.name for p in entry.parent.iterdir()] == [entry.name]  # old copy gone
    _biggest(entry).unlink()
    assert convert(str(src), progress=False) == entry  # re-converts, not "already there"
    assert orbax_store.cache_state(src)[1] == "ok"
    _same(first, load_model(str(src), progress=False))


@pytest.mark.parametrize("manifest", ["[1]", "{", "stale"])
def test_malformed_or_stale_manifest_is_rebuilt_once(cached, manifest, monkeypatch,
                                                     capfd) -> None:
    src, entry, first = cached
    if manifest == "stale":
        m = json.loads((entry / "manifest.json").read_text())
        m["source"]["size"] = 1
        manifest = json.dumps(m)
    (entry / "manifest.json").write_text(manifest)
    assert not orbax_store.is_converted(entry) or manifest.startswith("{\"")
    capfd.readouterr()
    _same(first, load_model(str(src), progress=False))
    assert "re-converting" in capfd.readouterr().err
    assert orbax_store.find_cached(src) == entry
    import gguf  # the next start reads the copy, not the GGUF

    with monkeypatch.context() as mp:
        mp.setattr(gguf, "GGUFReader", lambda *a, **k: pytest.fail("GGUF re-read"))
        _same(first, load_model(str(src), progress=False))
    (entry / "manifest.json").write_text("[1]")  # convert rebuilds it too
    assert convert(str(src), progress=False) == entry
    assert orbax_store.cache_state(src)[1] == "ok"


def test_a_foreign_directory_at_the_cache_key_is_left_alone(tmp_path: Path) -> None:
    src = write_tiny_gguf(tmp_path / "f.gguf", hf_weights())
    entry = orbax_store.cache_path_for(src)
    entry.mkdir(parents=True)
    (entry / "manifest.json").write_text("[1]")
    (entry / "thesis.tex").write_text("mine")
    with pytest.warns(UserWarning, match="could not cache"):
        load_model(str(src), progress=False)
    with pytest.raises(CheckpointError, match="not a converted checkpoint"):
        convert(str(src), progress=False)
    assert (entry / "thesis.tex").read_text() == "mine"


def test_a_copy_without_a_file_list_gets_one_after_a_good_load(cached) -> None:
    """Copies written before the manifest listed its files (N1 of session 30's recheck):
    the first good load records the sizes, so later damage is found by the cheap check
    (re-converted) instead of failing inside orbax's restore."""
    src, entry, first = cached
    m = json.loads((entry / "manifest.json").read_text())
    listed = m.pop("files")
    (entry / "manifest.json").write_text(json.dumps(m))
    _same(first, load_model(str(entry), progress=False))
    m2 = json.loads((entry / "manifest.json").read_text())
    assert m2["files"] == listed and {k: v for k, v in m2.items() if k != "files"} == m
    assert not list(entry.glob(".manifest.json.*"))  # no temp file left
    big = _biggest(entry)
    big.write_bytes(big.read_bytes()[:1000])
    assert orbax_store.cache_state(src)[1] == "damaged"
    _same(first, load_model(str(src), progress=False))  # re-made from the source


def test_backfill_lists_only_what_the_restore_reads_and_a_dead_backfill_is_harmless(
        cached) -> None:
    """helper-56: a user's note in the entry is not listed (editing it later must not make
    the copy "damaged" and get it re-made); a temp manifest left by a killed backfill does
    not make the entry look foreign, and is cleaned up by the next load."""
    src, entry, first = cached
    m = json.loads((entry / "manifest.json").read_text())
    listed = m.pop("files")
    (entry / "manifest.json").write_text(json.dumps(m))
    (entry / "README.txt").write_text("my note")
    dead = entry / ".manifest.json.tmp-999999"  # no such process
    dead.write_text("{partial")
    assert orbax_store.cache_state(src)[1] == "ok"
    _same(first, load_model(str(src), progress=False))
    files = json.loads((entry / "manifest.json").read_text())["files"]
    assert "README.txt" not in files and not dead.exists()
    assert files == {k: v for k, v in listed.items()
                     if k.startswith("params/") or k == "model_config.json"}
    (entry / "README.txt").write_text("my note, longer now")
    assert orbax_store.cache_state(src)[1] == "ok"


def test_a_read_only_copy_without_a_file_list_still_loads(cached, monkeypatch) -> None:
    """The manifest cannot be rewritten (a read-only cache; simulated, as root may write
    anywhere): the load succeeds, the manifest stays as it was, no temp file is left."""
    _, entry, first = cached
    m = json.loads((entry / "manifest.json").read_text())
    del m["files"]
    (entry / "manifest.json").write_text(json.dumps(m))

    def denied(*_a, **_k):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr("jaxinfer.loading.converted_check.os.replace", denied)
    _same(first, load_model(str(entry), progress=False))
    assert json.loads((entry / "manifest.json").read_text()) == m
    assert not list(entry.glob(".manifest.json.*"))


def test_a_symlinked_cache_entry_is_read_through_when_usable(cached, tmp_path,
                                                             monkeypatch) -> None:
    """A cache entry moved to another disk and linked back (N4 of session 30's recheck):
    a usable copy is read through the link; a damaged one is never re-made through it."""
    src, entry, first = cached
    moved = tmp_path / "other_disk" / entry.name
    moved.parent.mkdir()
    shutil.move(str(entry), moved)
    entry.symlink_to(moved, target_is_directory=True)
    assert orbax_store.cache_state(src)[1] == "ok"
    import jaxinfer.loading as loading

    def no_gguf(*_a, **_k):
        raise AssertionError("the GGUF was read although the linked copy is usable")

    with monkeypatch.context() as m:
        m.setattr(loading, "_load_gguf", no_gguf)
        _same(first, load_model(str(src), progress=False))
    big = _biggest(moved)
    big.write_bytes(big.read_bytes()[:1000])
    path, state, why = orbax_store.cache_state(src)
    assert state == "foreign" and "symbolic link" in why and "1000 bytes" in why
    with pytest.warns(UserWarning, match="not using the cache entry .* symbolic link") as w:
        _same(first, load_model(str(src), progress=False))  # from the GGUF
    assert len(w) == 1 and "re-convert" not in str(w[0].message)
    assert entry.is_symlink() and big.stat().st_size == 1000  # nothing re-made through it


@pytest.mark.parametrize("link", ["loop", "dangling", "to_a_file", "fails_to_load"])
def test_unusable_symlinked_entries_warn_once_and_are_never_touched(cached, tmp_path, link,
                                                                    capfd) -> None:
    """helper-56's break test: a symlink loop, a dangling link, a link to a file, and a link
    to a copy that passes the cheap checks but fails to restore (an old manifest without a
    file list, a data file cut short): one warning, the GGUF read, nothing re-made or
    deleted; ``jaxinfer convert`` refuses with one line before reading the model (not the
    last case: convert trusts the cheap checks)."""
    src, entry, first = cached
    moved = tmp_path / "elsewhere"
    shutil.move(str(entry), moved)
    if link == "loop":
        entry.symlink_to(entry.name)
    elif link == "dangling":
        entry.symlink_to(tmp_path / "nowhere")
    elif link == "to_a_file":
        (tmp_path / "a_file").write_text("mine")
        entry.symlink_to(tmp_path / "a_file")
    else:
        m = json.loads((moved / "manifest.json").read_text())
        del m["files"]
        (moved / "manifest.json").write_text(json.dumps(m))
        big = _biggest(moved)
        big.write_bytes(big.read_bytes()[: big.stat().st_size // 2])
        entry.symlink_to(moved, target_is_directory=True)
    capfd.readouterr()
    with pytest.warns(UserWarning, match="not using the cache entry") as w:
        _same(first, load_model(str(src), progress=False))
    assert len(w) == 1 and "re-convert" not in capfd.readouterr().err
    assert entry.is_symlink()
    if link == "to_a_file":
        assert (tmp_path / "a_file").read_text() == "mine"
    if link == "fails_to_load":
        return  # passes the cheap checks, which are all convert looks at
    import jaxinfer.loading as loading

    def no_gguf(*_a, **_k):
        raise AssertionError("convert read the GGUF before refusing")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(loading, "_load_gguf", no_gguf)
        with pytest.raises(CheckpointError, match="is not a usable converted copy"):
            convert(str(src))
