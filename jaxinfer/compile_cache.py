"""The compile cache: serialized programs, their manifest and fingerprint, and an XLA counter.

A compile cache directory holds one file per program (a ``jax.stages.Compiled`` serialized with
``jax.experimental.serialize_executable``, pickled with its input/output pytree definitions) and
``manifest.json``: the programs, their sha256 and compile seconds, and a fingerprint of
everything they depend on (model and engine configuration, parameter and KV pool shapes,
jax/jaxlib/flax versions, device kind and backend version, XLA flags, and a digest of the
jaxinfer and pallas_kernels sources). A store whose fingerprint differs from the running
configuration is never loaded: the difference is reported and the engine compiles instead
(or refuses, when strict).

Why serialized executables rather than JAX's persistent compilation cache or ``jax.export``:
measured on CPU with SmolLM2 (benchmarks/RESULTS.md, "Start-up"), deserializing an executable
was the fastest of the three, because it skips tracing and lowering as well as XLA
compilation. The persistent cache stores the same serialized executable but is keyed by a hash
of the lowered module, so it must trace and lower each bucket before it can look; ``jax.export``
skips tracing but still compiles (and needs ``flatbuffers``). The price is that nothing checks
the program against the code at load time, hence the source digest in the fingerprint.
Serialized executables are pickles: load only cache directories you wrote yourself.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import hashlib
import json
import logging
import os
import pickle
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax

from jaxinfer.batch import Bucket
from jaxinfer.config import ConfigError, EngineConfig, ModelConfig

log = logging.getLogger(__name__)

FORMAT = 1
MANIFEST = "manifest.json"


class CompileCacheError(ValueError):
    """A compile cache is missing, stale (fingerprint mismatch) or corrupt, in strict mode."""


class CompileCacheWarning(UserWarning):
    """A compile cache is missing, stale or corrupt: the engine compiles instead."""


# ----------------------------------------------------------------------------- XLA counter
# jax records "/jax/core/compile/backend_compile_duration" around every backend compile request
# (jax._src.dispatch.BACKEND_COMPILE_EVENT), including requests answered by JAX's persistent
# compilation cache, which also records ".../cache_hits". Their difference is the number of
# programs XLA actually compiled in this process. jax fires both in the thread that asked for
# the compile, so a per-thread count tells one thread's compiles from its neighbours' when
# programs are built in parallel (the server's warm-up, warmup.py).
_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT = "/jax/compilation_cache/cache_hits"
_counts = {"requests": 0, "hits": 0}
_counts_lock = threading.Lock()
_thread_counts = threading.local()


def _count(key: str) -> None:
    with _counts_lock:
        _counts[key] += 1
    setattr(_thread_counts, key, getattr(_thread_counts, key, 0) + 1)


def _on_duration(event: str, duration_secs: float, **_: str | int) -> None:
    if event == _BACKEND_COMPILE:
        _count("requests")


def _on_event(event: str, **_: str | int) -> None:
    if event == _CACHE_HIT:
        _count("hits")


jax.monitoring.register_event_duration_secs_listener(_on_duration)
jax.monitoring.register_event_listener(_on_event)


def xla_compilations(this_thread: bool = False) -> int:
    """Programs compiled by XLA in this process so far (persistent-cache hits excluded);
    ``this_thread``: only those compiled at the request of the calling thread."""
    if this_thread:
        return (getattr(_thread_counts, "requests", 0) - getattr(_thread_counts, "hits", 0))
    return _counts["requests"] - _counts["hits"]


class KeyLocks:
    """One lock per key, made on first use: threads that build the same program at the same
    time (a parallel warm-up beside the first request) build it once, others wait for it;
    different keys build in parallel."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._locks: dict[Any, threading.Lock] = {}

    def __call__(self, key: Any) -> threading.Lock:
        with self._lock:
            return self._locks.setdefault(key, threading.Lock())

    def get_or_build(self, cache: dict, key: Any, build: Callable[[], Any]) -> Any:
        """``cache[key]``, made by ``build()`` under ``key``'s lock if absent (the lock-free
        lookup first: the step loop asks for a built program every step)."""
        value = cache.get(key)
        if value is None:
            with self(key):
                value = cache.get(key)
                if value is None:
                    value = cache[key] = build()
        return value


@dataclass(frozen=True)
class Program:
    """One device program: a bucket and a mode."""

    mode: str
    bucket: Bucket

    @property
    def file(self) -> str:
        b = self.bucket
        return f"{self.mode}-{b.kind}-T{b.num_tokens}-S{b.num_seqs}-P{b.max_pages}.bin"



# ----------------------------------------------------------------------------- fingerprint
# Model fields that do not enter any program (stop tokens, names).
_NOT_IN_PROGRAMS = ("eos_token_ids", "bos_token_id", "name", "sampling_defaults")


# Sources whose code enters the traced programs (the runner's import closure; a test checks
# that list). Host-only modules (engine, scheduler, loading, ...) do not invalidate a cache.
PROGRAM_SOURCES = ("jaxinfer/batch.py", "jaxinfer/config.py", "jaxinfer/layers", "jaxinfer/models",
                   "jaxinfer/order_keys.py", "jaxinfer/quantization.py", "jaxinfer/row_reduce.py",
                   "jaxinfer/runner.py", "jaxinfer/runner_multi.py", "jaxinfer/runner_slots.py",
                   "jaxinfer/sampling.py", "jaxinfer/sampling_bad_words.py",
                   "jaxinfer/sampling_filters.py", "jaxinfer/sampling_noise.py",
                   "jaxinfer/sampling_params.py", "jaxinfer/sampling_penalties.py",
                   "jaxinfer/sampling_topk.py", "pallas_kernels")


# Kernel choices the programs read from the environment at trace time.
KERNEL_ENV_VARS = ("JAXINFER_FP8_DECODE", "JAXINFER_FP8_DECODE_GEMM", "JAXINFER_FP8_MID_GEMM",
                   "JAXINFER_DECODE_MERGE", "JAXINFER_FP8_DECODE_FUSE",
                   "JAXINFER_FP8_DECODE_DEEP_K", "JAXINFER_FP8_DECODE_TILES",
                   "JAXINFER_FP8_DECODE_FAST_ACCUM", "JAXINFER_FP8_DECODE_ROWS_AT_64")


def kernel_env() -> dict[str, str]:
    """{name: value in effect} of :data:`KERNEL_ENV_VARS`, defaults filled in (so a variable
    set to its default fingerprints as unset): part of the compile-cache fingerprint and of
    the benchmark records' config. The engine checks it at start, on every backend.

    Raises:
      ConfigError: a variable set to a value its kernel does not take (the message names it).
    """
    from pallas_kernels.matmul import fp8_plan
    from pallas_kernels.paged_attention import decode_merge, fp8

    try:
        env = {"JAXINFER_FP8_DECODE": fp8.env_variant(),
               "JAXINFER_DECODE_MERGE": decode_merge.env_merge(), **fp8_plan.env_values()}
    except ValueError as e:
        raise ConfigError(f"kernel environment variable: {e}") from None
    return env


def source_digest() -> str:
    """sha256 over PROGRAM_SOURCES' .py files (relative path + bytes, sorted)."""
    import pallas_kernels

    roots = {"jaxinfer": Path(__file__).parent, "pallas_kernels":
             Path(pallas_kernels.__file__).parent}
    files: list[tuple[str, Path]] = []
    for src in PROGRAM_SOURCES:
        pkg, _, rest = src.partition("/")
        path = roots[pkg] / rest
        found = sorted(path.rglob("*.py")) if path.is_dir() else [path] if path.is_file() else []
        files += [(f"{pkg}/{f.relative_to(roots[pkg])}", f) for f in found]
    h = hashlib.sha256()
    for name, f in files:
        h.update(name.encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def _abstract_tree(tree: Any) -> dict[str, Any]:
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {"treedef": str(jax.tree.structure(tree)),
            "leaves": [f"{jax.tree_util.keystr(p)}:{list(a.shape)}:{a.dtype}" for p, a in leaves]}


def fingerprint(model_config: ModelConfig, engine_config: EngineConfig, runner: Any) -> dict:
    """Everything the compiled programs of ``runner`` depend on, as a JSON-able dict."""
    import flax
    import jaxlib

    model = dataclasses.asdict(model_config)
    engine = dataclasses.asdict(engine_config)
    engine.pop("seed")  # seeds are program inputs
    engine.pop("async_scheduling")  # same programs either way (the gather ones always built)
    # Programs are keyed by k (multi-step ones carry it in their bucket): a cache built for
    # one k serves another, whose k-step programs then compile at first use.
    engine.pop("num_scheduler_steps")
    # Scheduling policy only: which requests run when, never a program's shape or code.
    for name in ("enable_prefix_caching", "max_consecutive_prefills", "max_queue_len",
                 "jump_forward"):
        engine.pop(name)
    backend = jax.extend.backend.get_backend()
    dev = jax.devices()[0]
    fp = {
        "model": {k: v for k, v in model.items() if k not in _NOT_IN_PROGRAMS},
        "engine": engine,
        "attention": f"{type(runner.attention).__name__}{sorted(vars(runner.attention).items())}",
        "params": _abstract_tree(runner.state),
        "kv_cache": _abstract_tree(runner.cache),
        "software": {"jax": jax.__version__, "jaxlib": jaxlib.__version__,
                     "flax": flax.__version__, "sources": source_digest()},
        "device": {"platform": dev.platform, "kind": dev.device_kind,
                   "count": jax.device_count(), "backend": backend.platform_version},
        # Kernel choices read from the environment at trace time.
        "env": kernel_env(),
        "xla": {"XLA_FLAGS": os.environ.get("XLA_FLAGS", ""),
                "matmul_precision": str(jax.config.jax_default_matmul_precision),
                "x64": bool(jax.config.jax_enable_x64)},
    }
    return json.loads(json.dumps(fp))  # tuples -> lists, as read back from the manifest


def diff_fingerprints(built: dict, now: dict, prefix: str = "") -> list[str]:
    """``key: built -> now`` for every leaf that differs (long values abbreviated)."""
    out: list[str] = []
    for k in sorted(set(built) | set(now)):
        a, b = built.get(k), now.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += diff_fingerprints(a, b, f"{prefix}{k}.")
        elif a != b:
            sa, sb = json.dumps(a), json.dumps(b)
            if len(sa) + len(sb) > 80:
                sa, sb = "(...)", "(changed)"
            out.append(f"{prefix}{k}: {sa} -> {sb}")
    return out


# ----------------------------------------------------------------------------- the store
class ProgramStore:
    """A compile cache directory: ``manifest.json`` and one serialized program per file.

    Use :meth:`open` to read (start-up) and :meth:`create` to write (``jaxinfer compile``).
    """

    def __init__(self, directory: Path, manifest: dict, strict: bool = False):
        self.directory = directory
        self.manifest = manifest
        self.strict = strict
        self.entries = {(e["mode"], Bucket(e["kind"], e["num_tokens"], e["num_seqs"],
                                           e["max_pages"])): e for e in manifest["programs"]}

    # -- reading
    @classmethod
    def open(cls, directory: str | Path, fp: dict, strict: bool = False) -> ProgramStore | None:
        """The store at ``directory`` if its fingerprint equals ``fp``.

        Returns None (after a warning) when the directory has no manifest or was built for
        another configuration. Raises CompileCacheError instead when ``strict``.
        """
        d = Path(directory).expanduser()
        try:
            manifest = json.loads((d / MANIFEST).read_text())
            if manifest.get("format") != FORMAT:
                raise ValueError(f"format {manifest.get('format')!r}, expected {FORMAT}")
        except (OSError, ValueError) as e:
            _refuse(strict, f"compile cache {d} is unusable ({e}); run `jaxinfer compile ... "
                            f"--cache-dir {d}` with this configuration",
                    "compiling programs as needed")
            return None
        diffs = diff_fingerprints(manifest["fingerprint"], fp)
        if diffs:
            more = "; ..." if len(diffs) > 6 else ""
            _refuse(strict, f"compile cache {d} was built for another configuration "
                            f"({'; '.join(diffs[:6])}{more}); rebuild it with "
                            f"`jaxinfer compile ... --cache-dir {d}`",
                    "compiling programs as needed")
            return None
        return cls(d, manifest, strict)

    def load(self, mode: str, bucket: Bucket) -> Any:
        """The deserialized program, or None (after a warning) if it is absent or unreadable.

        Raises CompileCacheError instead of returning None when strict.
        """
        e = self.entries.get((mode, bucket))
        if e is None:
            _refuse(self.strict, f"{mode} {bucket} is not in compile cache {self.directory}",
                    "compiling it")
            return None
        from jax.experimental import serialize_executable

        try:
            blob = (self.directory / e["file"]).read_bytes()
            if hashlib.sha256(blob).hexdigest() != e["sha256"]:
                raise ValueError("checksum mismatch")
            payload, in_tree, out_tree = pickle.loads(blob)
            return serialize_executable.deserialize_and_load(payload, in_tree, out_tree)
        except Exception as err:  # noqa: BLE001 - any unreadable entry means "compile it"
            _refuse(self.strict, f"compile cache entry {self.directory / e['file']} is "
                                 f"unreadable ({err})", "compiling it")
            return None

    # -- writing
    @classmethod
    def create(cls, directory: str | Path, fp: dict, force: bool = False) -> ProgramStore:
        """Open ``directory`` for writing: keep entries of the same fingerprint (unless
        ``force``), drop the files of a cache built for another configuration.

        Raises CompileCacheError when ``directory`` holds a ``manifest.json`` that is not a
        compile cache's (a converted checkpoint's, say) or does not parse: nothing there is
        touched (it used to be replaced, and the files it listed deleted), and when
        ``directory`` (or a parent) is an existing file or cannot be created, or is a
        non-empty folder without a manifest (someone else's files)."""
        d = Path(directory).expanduser()
        try:
            d.mkdir(parents=True, exist_ok=True)
        except FileExistsError:
            raise CompileCacheError(f"--cache-dir {d} is a file, not a directory") from None
        except OSError as err:
            raise CompileCacheError(f"--cache-dir {d} cannot be created: {err.strerror or err}"
                                    ) from None
        programs: list[dict] = []
        old = None
        if not (d / MANIFEST).exists() and any(d.iterdir()):
            # Every compile cache has its manifest from its first moment (written below):
            # a folder of other files is the user's, and programs are not written among them.
            raise CompileCacheError(f"--cache-dir {d} is not empty and holds no compile cache "
                                    f"({MANIFEST}): choose a new or empty folder")
        if (d / MANIFEST).exists():
            try:
                old = json.loads((d / MANIFEST).read_text())
            except (OSError, ValueError) as err:
                raise CompileCacheError(
                    f"{d / MANIFEST} does not parse ({err}): not writing a compile cache over "
                    f"it; delete it if it is an old compile cache, or choose another "
                    f"--cache-dir") from None
            if not (isinstance(old, dict) and isinstance(old.get("fingerprint"), dict)
                    and isinstance(old.get("programs"), list) and "format" in old):
                raise CompileCacheError(
                    f"{d} holds a {MANIFEST} that is not a jaxinfer compile cache's (a "
                    f"converted checkpoint?): choose another --cache-dir")
        if old is not None:
            same = old.get("format") == FORMAT and not diff_fingerprints(old["fingerprint"], fp)
            if same and not force:
                programs = [e for e in old["programs"] if (d / e["file"]).is_file()]
            else:
                if not same:
                    log.warning("replacing compile cache %s built for another configuration", d)
                for e in old.get("programs", []):
                    (d / e["file"]).unlink(missing_ok=True)
        store = cls(d, {"format": FORMAT, "fingerprint": fp, "programs": programs})
        store.write_manifest()
        return store

    def save(self, program: Program, blob: bytes, compile_seconds: float) -> dict:
        """Write ``blob`` (from :func:`serialize_program`) and record it in the manifest."""
        _atomic_write(self.directory / program.file, blob)
        b = program.bucket
        entry = {"mode": program.mode, "kind": b.kind, "num_tokens": b.num_tokens,
                 "num_seqs": b.num_seqs, "max_pages": b.max_pages, "file": program.file,
                 "sha256": hashlib.sha256(blob).hexdigest(), "bytes": len(blob),
                 "compile_seconds": round(compile_seconds, 4)}
        self.entries[(program.mode, b)] = entry
        self.manifest["programs"] = list(self.entries.values())
        self.write_manifest()
        return entry

    def write_manifest(self) -> None:
        """Write manifest.json atomically (temporary file + rename)."""
        self.manifest["written"] = _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")
        _atomic_write(self.directory / MANIFEST, json.dumps(self.manifest, indent=1).encode())


def serialize_program(compiled: Any) -> bytes:
    """Bytes of a ``jax.stages.Compiled``: the pickled ``serialize_executable.serialize``
    triple (executable payload, input and output pytree definitions)."""
    from jax.experimental import serialize_executable

    return pickle.dumps(serialize_executable.serialize(compiled))


def _refuse(strict: bool, message: str, fallback: str) -> None:
    """Raise CompileCacheError(message) when strict, else warn "message; fallback"."""
    if strict:
        raise CompileCacheError(message)
    warnings.warn(f"{message}; {fallback}", CompileCacheWarning, stacklevel=4)


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)
