"""hybridserve: disaggregated prefill/decode serving for hybrid Mamba2 + attention language models."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["LLM", "RequestOutput", "SamplingParams", "__version__"]

if TYPE_CHECKING:
    from hybridserve.common.outputs import RequestOutput
    from hybridserve.common.sampling_params import SamplingParams
    from hybridserve.engine.llm import LLM


def __getattr__(name: str) -> Any:
    # imported lazily so that `import hybridserve.kernels` does not pull in the engine
    if name == "LLM":
        from hybridserve.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from hybridserve.common.sampling_params import SamplingParams

        return SamplingParams
    if name == "RequestOutput":
        from hybridserve.common.outputs import RequestOutput

        return RequestOutput
    raise AttributeError(f"module 'hybridserve' has no attribute {name!r}")
