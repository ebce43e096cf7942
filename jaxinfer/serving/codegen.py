"""Regenerate the committed Python stubs from ``jaxinfer.proto`` (``python -m
jaxinfer.serving.codegen``).

The stubs are committed so that serving needs no protoc at run time. They are generated with the
grpcio-tools version pinned in the ``test`` extra of ``pyproject.toml``; the version stamp that
grpcio-tools writes into ``jaxinfer_pb2_grpc.py`` is the oldest grpcio the stubs accept, which
is why the pin matches the oldest grpcio the project supports (1.84). ``tests/serving/
test_stubs.py`` regenerates into a temporary directory and compares byte for byte.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

SERVING = Path(__file__).resolve().parent
ROOT = SERVING.parent.parent  # the import root: stubs import ``jaxinfer.serving.jaxinfer_pb2``
PROTO = "jaxinfer/serving/jaxinfer.proto"
STUBS = ("jaxinfer_pb2.py", "jaxinfer_pb2_grpc.py", "jaxinfer_pb2.pyi")


class CodegenError(RuntimeError):
    """protoc (grpcio-tools) failed or is not installed."""


def generate(out_dir: Path) -> dict[str, bytes]:
    """Run grpcio-tools' protoc on ``jaxinfer.proto``; returns {stub file name: contents}.

    Raises CodegenError when grpcio-tools is missing or protoc reports an error.
    """
    try:
        from grpc_tools import protoc
    except ImportError as e:
        raise CodegenError("grpcio-tools is not installed (pip install -e '.[test]')") from e
    import importlib.resources

    include = str(importlib.resources.files("grpc_tools") / "_proto")
    out = str(out_dir)
    rc = protoc.main(["grpc_tools.protoc", f"-I{ROOT}", f"-I{include}", f"--python_out={out}",
                      f"--pyi_out={out}", f"--grpc_python_out={out}", str(ROOT / PROTO)])
    if rc != 0:
        raise CodegenError(f"protoc failed on {PROTO} (exit {rc})")
    gen = Path(out) / "jaxinfer" / "serving"
    return {name: (gen / name).read_bytes() for name in STUBS}


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        for name, data in generate(Path(tmp)).items():
            (SERVING / name).write_bytes(data)
            print(f"wrote {SERVING / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
