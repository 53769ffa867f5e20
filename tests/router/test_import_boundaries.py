"""Import boundaries, checked in fresh interpreters: the shared `common` package and the router process load no
torch and none of the torch-heavy packages; the engine loads neither gRPC nor the proto modules."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

TORCH_HEAVY = ["torch", "triton", "hybridserve.engine", "hybridserve.models", "hybridserve.statepool", "hybridserve.kernels"]


def _loaded_after(imports: str, watch: list[str]) -> list[str]:
    code = f"import sys\n{imports}\nprint(' '.join(m for m in {watch!r} if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return done.stdout.split()


def test_the_router_imports_no_torch() -> None:
    imports = "\n".join(f"import hybridserve.router.{m}" for m in (
        "app", "http_server", "grpc_server", "frontend", "orchestrator", "policy", "prefix_index", "workers",
        "admission", "metrics", "openai_service", "openai_protocol", "cache_subscriber"))
    assert _loaded_after(imports, TORCH_HEAVY) == []


def test_common_and_proto_import_no_torch() -> None:
    common = sorted(p.stem for p in (Path(__file__).resolve().parents[2] / "common").glob("*.py") if p.stem != "__init__")
    assert "sampling_params" in common
    imports = "\n".join([*(f"import hybridserve.common.{m}" for m in common), "import hybridserve.proto.convert"])
    assert _loaded_after(imports, [*TORCH_HEAVY, "transformers", "tokenizers"]) == []


@pytest.mark.parametrize("module", ["hybridserve.engine.llm_engine", "hybridserve.engine.llm"])
def test_the_engine_imports_no_grpc(module: str) -> None:
    assert _loaded_after(f"import {module}", ["grpc", "hybridserve.proto"]) == []
