"""The committed gRPC stubs are exactly what the pinned grpcio-tools generates from the .proto."""

from __future__ import annotations

from pathlib import Path

import pytest

from jaxinfer.serving import codegen


def test_committed_stubs_match_proto(tmp_path: Path):
    pytest.importorskip("grpc_tools", reason="grpcio-tools is in the test extra")
    fresh = codegen.generate(tmp_path)
    assert set(fresh) == set(codegen.STUBS)
    for name, data in fresh.items():
        committed = (codegen.SERVING / name).read_bytes()
        assert committed == data, (f"jaxinfer/serving/{name} is stale: run "
                                   f"`python -m jaxinfer.serving.codegen` and commit")


def test_proto_names_match_sampling_params():
    """Every SamplingParams field (but n, and output_kind: how the engine's Python API hands
    out outputs; the server always reads deltas, and a client picks streaming or unary by the
    RPC) has a SamplingParameters field of the same name."""
    import dataclasses

    from jaxinfer.sampling_params import SamplingParams
    from jaxinfer.serving import jaxinfer_pb2 as pb

    proto = set(pb.SamplingParameters.DESCRIPTOR.fields_by_name)
    missing = {f.name for f in dataclasses.fields(SamplingParams)} - proto - {"n", "output_kind"}
    assert "output_kind" not in proto
    assert not missing, f"add {sorted(missing)} to SamplingParameters in jaxinfer.proto"
