"""Offline engine: scheduler, model runner, sampler and the `LLM` API.

Names are imported on first use (PEP 562), so importing one module of this package does not load the rest
of it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hybridserve.common.lazy_exports import lazy_getattr

_EXPORTS = {
    "EngineConfig": "hybridserve.engine.config",
    "LLM": "hybridserve.engine.llm",
    "LLMEngine": "hybridserve.engine.llm_engine",
}
__all__ = [
    "EngineConfig",
    "LLM",
    "LLMEngine",
]

if TYPE_CHECKING:
    from hybridserve.engine.config import EngineConfig
    from hybridserve.engine.llm import LLM
    from hybridserve.engine.llm_engine import LLMEngine

__getattr__ = lazy_getattr(__name__, _EXPORTS)
