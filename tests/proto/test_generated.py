"""The committed generated modules are exactly what `proto/generate.py` writes from the .proto files."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parents[2] / "proto"


def _load_generator():
    spec = importlib.util.spec_from_file_location("proto_generate", PROTO_ROOT / "generate.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["proto_generate"] = module
    spec.loader.exec_module(module)
    return module


def test_regenerating_changes_nothing(tmp_path: Path) -> None:
    generated = _load_generator().generate(tmp_path)
    assert {p.name for p in generated} >= {"worker_pb2.py", "worker_pb2_grpc.py", "router_pb2.py", "common_pb2.py"}
    for path in generated:
        committed = PROTO_ROOT / "hybridserve" / "v1" / path.name
        assert committed.is_file(), f"{committed} is not committed; run python proto/generate.py"
        assert committed.read_text() == path.read_text(), f"{committed.name} is stale; run python proto/generate.py"


def test_generated_modules_import_under_the_package() -> None:
    from hybridserve.proto import worker_pb2, worker_pb2_grpc

    chunk = worker_pb2.StateChunk(trailer=worker_pb2.StateTrailer(digest=7))
    assert worker_pb2.StateChunk.FromString(chunk.SerializeToString()).trailer.digest == 7
    assert hasattr(worker_pb2_grpc, "DecodeWorkerStub") and hasattr(worker_pb2_grpc, "PrefillWorkerStub")
