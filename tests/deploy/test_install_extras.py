"""The install split: `pip install -e .` brings the runtime only; the `test` extra what the suite, ruff and mypy
need; evaluation, plotting and the NIXL plane their own extras; CI installs what the README's test command does."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")

ROOT = Path(__file__).resolve().parents[2]
TEST_ONLY = {"pytest", "hypothesis", "grpcio-tools", "openai", "httpx", "jsonschema", "llguidance", "cryptography",
             "ruff", "mypy", "lm-eval", "langchain-openai", "datasets", "matplotlib", "nixl", "pandas", "pyarrow"}


def _names(requirements: list[str]) -> set[str]:
    return {re.split(r"[<>=!~\[;\s]", r, maxsplit=1)[0].lower() for r in requirements}


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_runtime_dependencies_hold_no_test_eval_or_plot_package() -> None:
    runtime = _names(_project()["dependencies"])
    assert not runtime & TEST_ONLY, runtime & TEST_ONLY
    assert {"torch", "transformers", "grpcio", "fastapi", "ray"} <= runtime


def test_extras_split_as_the_readme_says() -> None:
    extras = {name: _names(reqs) for name, reqs in _project()["optional-dependencies"].items()}
    assert {"pytest", "hypothesis", "grpcio-tools", "triton", "openai", "httpx", "jsonschema", "llguidance",
            "cryptography", "ruff", "mypy"} <= extras["test"]
    assert not extras["test"] & {"lm-eval", "langchain-openai", "datasets", "matplotlib", "nixl"}
    assert {"lm-eval", "langchain-openai"} <= extras["eval"] and extras["plot"] == {"matplotlib"}
    assert extras["nixl"] == {"nixl"}


def test_ci_installs_the_test_extra() -> None:
    """.ci/run runs the README's test command as written (the test extra, then pytest)."""
    ci = (ROOT / ".ci" / "run").read_text()
    readme = (ROOT / "README.md").read_text().splitlines()
    command = next(line for line in readme if '".[test]"' in line and "pytest" in line)
    assert 'pip install -c constraints.txt -e ".[test]"' in command
    assert command.strip() in ci.splitlines() and "[dev]" not in ci


def test_the_cli_and_server_modules_import_without_test_packages() -> None:
    """A runtime-only install serves: nothing on the serving path imports a test-only package."""
    import subprocess

    blocked = ["pytest", "hypothesis", "openai", "httpx", "jsonschema", "llguidance", "lm_eval", "langchain_openai",
               "datasets", "matplotlib", "triton"]
    code = (f"import sys\nfor name in {blocked!r}: sys.modules[name] = None\n"
            "import hybridserve.cli, hybridserve.deploy.serve, hybridserve.deploy.cluster_up\n"
            "import hybridserve.decode_worker.worker, hybridserve.prefill_worker.worker\n"
            "from hybridserve.engine.llm import LLM\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
