"""The offline API: `LLM(model_dir).generate(...)`."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from tqdm import tqdm

from hybridserve.common.generation_defaults import load_generation_defaults
from hybridserve.common.outputs import RequestOutput
from hybridserve.common.sampling_params import SamplingParams
from hybridserve.engine.config import EngineConfig
from hybridserve.engine.llm_engine import LLMEngine
from hybridserve.models.default_model import default_model_dir


class LLM:
    """Batch generation over a hybrid checkpoint. `model=None` loads the embedded default model."""

    def __init__(self, model: str | Path | None = None, *, generation_config: str = "auto",
                 **engine_kwargs: object) -> None:
        """`generation_config`: where `get_default_sampling_params` (and `generate` without sampling params)
        takes its defaults: "auto" (the checkpoint's generation_config.json), "none", or a folder."""
        model_dir = default_model_dir() if model is None else Path(model)
        if not model_dir.is_dir():
            raise ValueError(f"model directory {model_dir} does not exist")
        self.generation_defaults = load_generation_defaults(generation_config, model_dir)
        try:
            config = EngineConfig(**engine_kwargs)  # type: ignore[arg-type]
        except TypeError as exc:
            raise ValueError(f"unknown LLM option: {exc}") from exc
        self.engine = LLMEngine(model_dir, config)

    @property
    def tokenizer(self):  # noqa: ANN201 - Tokenizer | None
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams() under the checkpoint's generation defaults (as vLLM's LLM does)."""
        return self.generation_defaults.sampling_params()

    def generate(
        self,
        prompts: str | Sequence[str] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs come back in prompt order."""
        if (prompts is None) == (prompt_token_ids is None):
            raise ValueError("give exactly one of `prompts` (text) or `prompt_token_ids`")
        if prompts is not None:
            texts = [prompts] if isinstance(prompts, str) else list(prompts)
            token_lists = [self.engine.encode(text) for text in texts]
        else:
            token_lists = [list(ids) for ids in prompt_token_ids]  # type: ignore[union-attr]
        if not token_lists:
            return []
        if sampling_params is None:
            params_list = [self.get_default_sampling_params()] * len(token_lists)
        elif isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(token_lists)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(token_lists):
                raise ValueError(f"{len(params_list)} sampling_params for {len(token_lists)} prompts")
        for tokens in token_lists:  # validate all before anything runs
            self.engine.validate_prompt(tokens)
        ids = [self.engine.add_request(tokens, params) for tokens, params in zip(token_lists, params_list)]
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="generate", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                        bar.update(1)
        return [finished[i] for i in ids]

    def prompt_logits(self, prompt_token_ids: Sequence[int]) -> torch.Tensor:
        """Logits at every prompt position [L, vocab], fp32."""
        return self.engine.prompt_logits(list(prompt_token_ids))
