"""JAX's persistent compilation cache, on by default for ``jaxinfer generate | chat | serve``.

vLLM keeps its torch.compile artefacts under ``~/.cache/vllm`` so that the next start skips
the compile; the counterpart here is JAX's persistent compilation cache: XLA executables
keyed by the lowered program, the compile options, the device and the jax / jaxlib versions
(``jax._src.compilation_cache``), so a changed model, bucket or version misses and compiles.
Lowering still runs to compute the key; the XLA compile is what is saved (SmolLM2 on a 2-core
CPU: `jaxinfer generate` builds its 13 programs in ~16 s cold and ~5 s from this cache).

It is not `jaxinfer compile`'s compile cache (``--cache-dir``): that one holds a whole bucket
set, serialized ahead of time and loaded without tracing (jaxinfer/compile.py).

Where (:func:`choose`): ``--xla-cache-dir DIR``; else a cache this process already has
(``$JAX_COMPILATION_CACHE_DIR`` or ``jax.config``), left as it is; else
``$JAXINFER_XLA_CACHE_DIR``; else ``$XDG_CACHE_HOME/jaxinfer/xla`` (``~/.cache/jaxinfer/xla``).
``off`` (flag or variable) turns it off; ``--xla-cache-dir off`` also turns off a cache
JAX already had. A cache set up here holds at most
:data:`MAX_BYTES` (JAX's ``jax_compilation_cache_max_size``: least recently used entries go
first, and reads and writes take a file lock, so processes starting together do not read a
half-written entry); a cache JAX already had keeps its own settings.
"""

from __future__ import annotations

import logging
import os
import tempfile
import warnings
from pathlib import Path

from jaxinfer.cache_root import cache_root

log = logging.getLogger(__name__)

ENV = "JAXINFER_XLA_CACHE_DIR"
OFF = ("off", "none")  # and an empty $JAXINFER_XLA_CACHE_DIR (an empty flag is refused)
# Every program is written (JAX's default skips those compiled in under 1 s: most of a small
# model's programs on the CPU, which a start would then compile again).
MIN_COMPILE_SECONDS = 0.0
# Bytes on disk before the least recently used entries are evicted (the demo's 13 SmolLM2
# programs on the CPU take ~1 MB).
MAX_BYTES = 8 << 30
FROM_JAX = "jax.config (JAX_COMPILATION_CACHE_DIR)"  # choose()'s source for JAX's own cache


def default_dir() -> Path:
    """``$XDG_CACHE_HOME/jaxinfer/xla``, or ``~/.cache/jaxinfer/xla`` without the variable
    (:func:`jaxinfer.cache_root.cache_root`)."""
    return cache_root() / "xla"


def _dir_or_off(value: str) -> Path | None:
    """``value`` as a directory, or None where it says off (empty counts as off)."""
    return None if value.strip().lower() in (*OFF, "") else Path(value).expanduser()


def choose(flag: str | None, env: str | None, configured: str | None
           ) -> tuple[Path | None, str]:
    """(directory or None for off, where the choice came from) — the precedence in the
    module docstring. ``flag``: ``--xla-cache-dir``; ``env``: ``$JAXINFER_XLA_CACHE_DIR``;
    ``configured``: the directory JAX already has in this process."""
    if flag is not None:
        if not flag.strip():
            raise ValueError("--xla-cache-dir is empty: give a directory, or 'off'")
        return _dir_or_off(flag), "--xla-cache-dir"
    if configured:
        return Path(configured), FROM_JAX
    if env is not None:
        return _dir_or_off(env), f"${ENV}"
    return default_dir(), "default"


def _jax_cache_dir() -> str | None:
    """The persistent cache directory JAX has in this process (None: none)."""
    import jax

    return jax.config.jax_compilation_cache_dir


def active_dir() -> str | None:
    """JAX's persistent cache directory where the cache is on in this process (a directory
    set and ``jax_enable_compilation_cache``, as JAX's own ``is_persistent_cache_enabled``);
    None otherwise."""
    import jax

    directory = _jax_cache_dir()
    return directory if directory is not None and jax.config.jax_enable_compilation_cache \
        else None


def enable(flag: str | None = None) -> Path | None:
    """Turn on JAX's persistent compilation cache where :func:`choose` says; returns the
    directory, or None when it is off or the default location cannot be written (a warning
    says why: programs then compile at every start, as without the cache).

    Raises:
      ValueError: a directory named by ``--xla-cache-dir`` or ``$JAXINFER_XLA_CACHE_DIR``
        cannot be created or written (the message names it and where it came from), or
        ``--xla-cache-dir`` is empty.
    """
    import jax

    configured = _jax_cache_dir()
    directory, source = choose(flag, os.environ.get(ENV), configured)
    if directory is None:
        if configured:  # only an explicit --xla-cache-dir off gets here: JAX's cache off too
            jax.config.update("jax_enable_compilation_cache", False)
        log.info("XLA compilation cache off (%s)", source)
        return None
    if source == FROM_JAX:
        return directory  # the user's own JAX setting, as they made it
    try:
        if directory.exists() and not directory.is_dir():
            raise NotADirectoryError("not a directory")
        directory.mkdir(parents=True, exist_ok=True)
        # a file really written (os.access says yes to root everywhere, /proc included,
        # where JAX then waits out its file lock's timeout at every read and write)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".write-test-"):
            pass
    except OSError as e:
        why = e.strerror or str(e)
        if source == "default":
            warnings.warn(f"XLA compilation cache {directory}: {why}; programs will be "
                          f"compiled at every start (set {ENV} to another directory)",
                          stacklevel=2)
            return None
        raise ValueError(f"{source} {directory}: cannot be used as the XLA compilation cache "
                         f"({why}); give a writable directory, or 'off'") from None
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
    jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
    log.info("XLA compilation cache: %s (%s)", directory, source)
    return directory
