"""Import boundaries, checked in fresh interpreters: the router process loads no torch and no engine machinery;
the engine loads neither gRPC nor the proto modules."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _loaded_after(imports: str, watch: list[str]) -> list[str]:
    code = f"import sys\n{imports}\nprint(' '.join(m for m in {watch!r} if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return done.stdout.split()


def test_the_router_imports_no_torch() -> None:
    imports = "\n".join(f"import hybridserve.router.{m}" for m in (
        "app", "http_server", "grpc_server", "frontend", "orchestrator", "policy", "prefix_index", "workers",
        "admission", "metrics", "openai_service", "openai_protocol", "cache_subscriber"))
    assert _loaded_after(imports, ["torch", "triton", "hybridserve.engine.llm_engine", "hybridserve.kernels"]) == []


@pytest.mark.parametrize("module", ["hybridserve.engine.llm_engine", "hybridserve.engine.llm"])
def test_the_engine_imports_no_grpc(module: str) -> None:
    assert _loaded_after(f"import {module}", ["grpc", "hybridserve.proto"]) == []
