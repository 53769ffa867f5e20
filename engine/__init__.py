"""Offline engine: scheduler, model runner, sampler and the `LLM` API."""

from hybridserve.engine.config import EngineConfig
from hybridserve.engine.llm import LLM
from hybridserve.engine.llm_engine import LLMEngine
from hybridserve.engine.outputs import RequestOutput
from hybridserve.engine.sampling_params import SamplingParams

__all__ = ["LLM", "EngineConfig", "LLMEngine", "RequestOutput", "SamplingParams"]
