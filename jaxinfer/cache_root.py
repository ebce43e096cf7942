"""Where jaxinfer keeps what it makes on a user's machine, as Hugging Face's hub and vLLM do:
``$XDG_CACHE_HOME/jaxinfer`` (the XDG base directory specification), else
``~/.cache/jaxinfer``. The XLA compilation cache (``xla_cache.default_dir``) and the
checkpoint store's fallback (``loading.orbax_store.checkpoint_dir``) live under it."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """``$XDG_CACHE_HOME/jaxinfer`` (a leading ``~`` expanded, as before this helper);
    ``~/.cache/jaxinfer`` where the variable is unset, empty or relative (the specification:
    "a relative path ... should be considered invalid and ignored"). Nothing is created."""
    xdg = Path(os.environ.get("XDG_CACHE_HOME", "")).expanduser()  # "" -> Path(".")
    base = xdg if xdg.is_absolute() else Path.home() / ".cache"
    return base / "jaxinfer"
