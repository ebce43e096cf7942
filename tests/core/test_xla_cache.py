"""JAX's persistent compilation cache for `jaxinfer generate | chat | serve`
(jaxinfer/xla_cache.py): where it goes, that a second start compiles nothing, that ``off``
turns it off, and that an unusable directory fails by name."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from jaxinfer import cli, xla_cache
from jaxinfer.xla_cache import ENV, FROM_JAX, choose, default_dir, enable


def test_choose_follows_the_documented_precedence(tmp_path, monkeypatch):
    f, e, c = str(tmp_path / "flag"), str(tmp_path / "env"), str(tmp_path / "jax")
    assert choose(f, e, c) == (Path(f), "--xla-cache-dir")  # the flag beats everything
    assert choose("off", e, c) == (None, "--xla-cache-dir")
    assert choose(None, e, c) == (Path(c), FROM_JAX)
    assert choose(None, e, None) == (Path(e), f"${ENV}")
    assert choose(None, "OFF", None) == (None, f"${ENV}")
    assert choose(None, "", None) == (None, f"${ENV}")  # set but empty: off
    with pytest.raises(ValueError, match="--xla-cache-dir is empty"):
        choose(" ", e, c)  # an empty "$DIR" in a script: refused, not silently off
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert choose(None, None, None) == (tmp_path / "xdg" / "jaxinfer" / "xla", "default")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_dir() == Path.home() / ".cache" / "jaxinfer" / "xla"
    assert choose("~/x", None, None)[0] == Path.home() / "x"


def test_a_cache_this_process_has_is_left_as_it_is():
    before = jax.config.jax_compilation_cache_dir  # the test suite's (conftest)
    assert before and enable() == Path(before)
    assert jax.config.jax_compilation_cache_dir == before


def test_an_unusable_directory_is_refused_by_name(tmp_path, capsys):
    not_dir = tmp_path / "a-file"
    not_dir.write_text("x")
    before = jax.config.jax_compilation_cache_dir
    assert cli.main(["generate", "--model", "dummy:tiny-llama", "--token-ids",
                     "--xla-cache-dir", str(not_dir), "1 2"]) == 2
    err = capsys.readouterr().err
    assert f"jaxinfer: error: --xla-cache-dir {not_dir}: cannot be used as the XLA " \
           "compilation cache (not a directory)" in err, err
    assert jax.config.jax_compilation_cache_dir == before  # nothing changed


def test_a_directory_that_takes_no_file_is_refused(tmp_path):
    """/proc: os.access says writable to root, JAX's file lock then times out at every
    read and write (a helper's run hung): a real file is written first."""
    if not Path("/proc").is_dir():
        pytest.skip("no /proc on this system")
    with pytest.raises(ValueError, match=r"--xla-cache-dir /proc: cannot be used as the "
                                         r"XLA compilation cache"):
        enable("/proc")


def _generate(env: dict[str, str], *extra: str) -> tuple[int, int]:
    """(programs compiled, programs from a cache) of one `jaxinfer generate` process."""
    out = subprocess.run([sys.executable, "-m", "jaxinfer.cli", "generate", "--model",
                          "dummy:tiny-llama", "--token-ids", "--max-tokens", "2", *extra,
                          "1 2 3"], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    m = re.search(r"building (\d+) compiled \+ (\d+) cached programs", out.stderr)
    assert m, out.stderr
    return int(m.group(1)), int(m.group(2))


def test_off_sets_nothing_up_and_turns_off_a_cache_jax_had(monkeypatch):
    updates = []
    monkeypatch.setattr(jax.config, "update", lambda *a: updates.append(a))
    monkeypatch.setenv(ENV, "off")  # JAX already has the suite's cache: that one stays
    assert enable() == Path(jax.config.jax_compilation_cache_dir) and updates == []
    assert enable("off") is None and enable(" None ") is None  # the flag: JAX's off too
    assert updates == [("jax_enable_compilation_cache", False)] * 2
    monkeypatch.setattr(xla_cache, "_jax_cache_dir", lambda: None)
    updates.clear()
    assert enable("off") is None and updates == []  # no cache anywhere: nothing to do


def test_second_start_compiles_nothing(tmp_path):
    env = {k: v for k, v in os.environ.items()
           if k not in (ENV, "JAX_COMPILATION_CACHE_DIR")}
    env.update(XDG_CACHE_HOME=str(tmp_path), JAX_PLATFORMS="cpu",
               PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    compiled, cached = _generate(env)
    assert compiled > 0 and cached == 0
    where = tmp_path / "jaxinfer" / "xla"
    assert len(list(where.glob("*-cache"))) >= compiled  # written at the default location
    assert (where / ".lockfile").exists()  # a size cap (MAX_BYTES): LRU eviction, file lock
    assert _generate(env) == (0, compiled)  # the next start: every program from the cache


def test_the_caches_share_one_root_that_follows_xdg_cache_home(tmp_path, monkeypatch):
    """The XLA cache and the checkpoint store's fallback both live under cache_root():
    $XDG_CACHE_HOME/jaxinfer (the fallback used to ignore the variable); a relative or empty
    value is ignored, as the XDG specification says."""
    from jaxinfer.cache_root import cache_root
    from jaxinfer.loading import orbax_store

    monkeypatch.delenv("JAXINFER_CHECKPOINT_DIR", raising=False)
    # a module path outside a source tree, so checkpoint_dir() falls back to the cache
    monkeypatch.setattr(orbax_store, "__file__", str(tmp_path / "site" / "pkg" / "m.py"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "jaxinfer"
    assert default_dir() == tmp_path / "xdg" / "jaxinfer" / "xla"
    assert orbax_store.checkpoint_dir() == tmp_path / "xdg" / "jaxinfer" / "checkpoints"
    home = Path.home() / ".cache" / "jaxinfer"
    monkeypatch.setenv("XDG_CACHE_HOME", "~/xdg")  # expanded, as the XLA cache did before
    assert cache_root() == Path.home() / "xdg" / "jaxinfer"
    for ignored in ("relative/dir", ""):
        monkeypatch.setenv("XDG_CACHE_HOME", ignored)
        assert cache_root() == home
        assert orbax_store.checkpoint_dir() == home / "checkpoints"
    monkeypatch.setattr(orbax_store, "__file__", str(tmp_path / "repo" / "jaxinfer" / "loading"
                                                     / "orbax_store.py"))
    (tmp_path / "repo" / "checkpoints").mkdir(parents=True)
    (tmp_path / "repo" / "pyproject.toml").write_text("")
    assert orbax_store.checkpoint_dir() == tmp_path / "repo" / "checkpoints"  # a source tree
