"""The engine loop: requests in, `step()` runs one scheduled forward, outputs out."""

from __future__ import annotations

import itertools
import logging
from pathlib import Path

import torch

from hybridserve.engine.config import DTYPES, EngineConfig
from hybridserve.engine.model_runner import ModelRunner
from hybridserve.engine.outputs import RequestOutput
from hybridserve.engine.request import Request, RequestStatus
from hybridserve.engine.sampling_params import SamplingParams
from hybridserve.engine.scheduler import Scheduler
from hybridserve.models.config import ModelConfig
from hybridserve.models.tokenizer import load_tokenizer
from hybridserve.models.weights import load_model
from hybridserve.statepool.allocators import PageAllocator, SlotAllocator
from hybridserve.statepool.sizing import memory_budget_bytes, plan_cache_layout
from hybridserve.statepool.state_cache import StateCache

logger = logging.getLogger(__name__)

DEFAULT_MAX_MODEL_LEN = 8192  # for models that declare no positional limit (Mamba2)


class LLMEngine:
    def __init__(self, model_dir: str | Path, config: EngineConfig) -> None:
        self.config = config
        self.model_dir = Path(model_dir)
        self.model_config = ModelConfig.from_dir(self.model_dir)
        device = config.torch_device
        self.model = load_model(self.model_dir, self.model_config, config.torch_dtype, device)
        self.tokenizer = load_tokenizer(self.model_dir)
        if self.tokenizer is not None and self.tokenizer.vocab_size > self.model_config.vocab_size:
            raise ValueError(
                f"tokenizer has {self.tokenizer.vocab_size} tokens, the model's vocab_size is "
                f"{self.model_config.vocab_size}"
            )
        self.max_model_len = (
            config.max_model_len or self.model_config.max_position_embeddings or DEFAULT_MAX_MODEL_LEN
        )
        ssm_dtype = DTYPES[self.model_config.ssm_state_dtype]
        conv_width = self.model_config.mamba.conv_kernel - 1 if self.model_config.mamba else 1
        layout = plan_cache_layout(
            self.model_config,
            memory_budget_bytes(device, config.cpu_memory_gb, config.gpu_memory_utilization),
            config.max_num_seqs,
            self.max_model_len,
            config.page_size,
            config.torch_dtype,
            ssm_dtype,
            conv_width,
        )
        self.cache = StateCache(self.model_config, layout, config.torch_dtype, ssm_dtype, device)
        has_attention = bool(self.model_config.layers_of("attention"))
        has_mamba = bool(self.model_config.layers_of("mamba"))
        self.scheduler = Scheduler(
            PageAllocator(layout.num_pages) if has_attention else None,
            SlotAllocator(layout.num_slots) if has_mamba else None,
            config.page_size,
            config.prefill_chunk_size,
            layout.num_slots,
        )
        self.runner = ModelRunner(self.model, self.cache, config.page_size, device)
        self._requests: dict[str, Request] = {}
        self._counter = itertools.count()
        self._seeds = torch.Generator().manual_seed(config.seed)

    # ---- requests -------------------------------------------------------------------------------
    def validate_prompt(self, prompt_token_ids: list[int]) -> list[int]:
        """Clear ValueErrors for prompts the model cannot take."""
        if len(prompt_token_ids) == 0:
            raise ValueError("the prompt is empty: give at least one token")
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_token_ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be integers in [0, {vocab}); got {bad[:5]}")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(prompt_token_ids)} tokens; the model's limit is max_model_len="
                f"{self.max_model_len} tokens, prompt plus at least one generated token"
            )
        return list(prompt_token_ids)

    def encode(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError(f"{self.model_dir} ships no tokenizer: pass prompt_token_ids instead of text")
        if not isinstance(prompt, str):
            raise ValueError(f"a prompt must be a string, got {type(prompt).__name__}")
        return self.tokenizer.encode(prompt)

    def add_request(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> str:
        tokens = self.validate_prompt(prompt_token_ids)
        request_id = request_id if request_id is not None else f"req-{next(self._counter)}"
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,), generator=self._seeds))
        request = Request(request_id, tokens, params, seed, arrival=len(self._requests))
        self._requests[request_id] = request
        self.scheduler.add(request)
        return request_id

    def abort(self, request_id: str) -> None:
        request = self._requests.pop(request_id, None)
        if request is not None and not request.finished:
            self.scheduler.finish(request, "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the loop -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward, append sampled tokens, apply stop rules; returns updated requests."""
        work = self.scheduler.schedule()
        if work.is_empty:
            return []
        sampled = self.runner.execute(work)
        updated: list[RequestOutput] = []
        for request, count in work.chunks():
            request.num_computed_tokens += count
            token = sampled.get(request.request_id)
            if token is None:
                continue
            request.output_token_ids.append(token)
            reason = self._stop_reason(request, token)
            if reason is not None:
                self.scheduler.finish(request, reason)
            updated.append(self._output(request))
            if request.finished:
                self._requests.pop(request.request_id, None)
        return updated

    def _stop_reason(self, request: Request, token: int) -> str | None:
        params = request.params
        if not params.ignore_eos and token in self.model_config.eos_token_ids:
            return "stop"
        if token in params.stop_token_ids:
            return "stop"
        if len(request.output_token_ids) >= params.max_tokens or request.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _output(self, request: Request) -> RequestOutput:
        text = self.tokenizer.decode(request.output_token_ids) if self.tokenizer is not None else None
        return RequestOutput(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            token_ids=list(request.output_token_ids),
            text=text,
            finish_reason=request.finish_reason,
            num_cached_tokens=request.num_cached_tokens,
            finished=request.status is RequestStatus.FINISHED,
        )

    def prompt_logits(self, prompt_token_ids: list[int]) -> torch.Tensor:
        """Logits at every prompt position [L, vocab] in one pass (scoring; no generation)."""
        tokens = self.validate_prompt(prompt_token_ids)
        request = Request("score", tokens, SamplingParams(max_tokens=1), seed=0, arrival=-1)
        scheduler = self.scheduler
        if scheduler.slots is not None:
            request.state_slot = scheduler.slots.allocate(1)[0]
        try:
            if not scheduler.reserve_pages(request, len(tokens)):
                raise ValueError(f"not enough free KV pages to score {len(tokens)} tokens now")
            return self.runner.prompt_logits(request)
        finally:
            if scheduler.pages is not None and request.page_ids:
                scheduler.pages.free(request.page_ids)
            if scheduler.slots is not None and request.state_slot is not None:
                scheduler.slots.free([request.state_slot])
