"""Stage a prompt's final state layer by layer, inside the forward of its last prefill chunk.

`ForwardBatch.layer_done` calls a `LayerStager` right after each layer was queued. Once the last attention
layer ran, the KV rows not staged at earlier chunk boundaries are final (they lie in `kv_tail`, behind the
Mamba states in the early layout: `state_layout.split_kv_specs`); once Mamba layer i ran, its SSM state and
conv window for the request are. Each is copied into the request's arena block on a side CUDA stream that
waits for an event recorded after that layer only, so the copy and the send of layer i overlap layers i+1...
After the model's last layer the loop's stream waits for the side stream: nothing later (the request's slot
and pages being reused, the step-end staging of the rest) can overtake a copy. On CPU the copies run at once
and count as ready (no events), so tests run the same path.
"""

from __future__ import annotations

from typing import Protocol

import torch

from hybridserve.common.model_config import ModelConfig
from hybridserve.statepool.state_cache import StateCache
from hybridserve.transfer.early_state import EarlyState


class PagedRequest(Protocol):
    """What the stager reads of the engine's `Request` (transfer/ does not import the engine)."""

    @property
    def page_ids(self) -> list[int]: ...
    @property
    def state_slot(self) -> int | None: ...


class LayerStager:
    """`on_layer` hook (`LLMEngine.add_request`) of one early-sent request: stages its state as layers finish."""

    def __init__(self, early: EarlyState, cache: StateCache, config: ModelConfig, device: torch.device) -> None:
        self.early = early
        self.cache = cache
        self._mamba = {layer: index for index, layer in enumerate(config.layers_of("mamba"))}  # layer -> pool index
        attention = config.layers_of("attention")  # (an MTP module's KV is written by the drafter, not here)
        self._last_attention = attention[-1] if attention else None
        self._last_layer = len(config.layer_types) - 1
        self._device = device
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def __call__(self, request: PagedRequest, layer: int) -> None:
        early = self.early
        if early.streaming and (layer == self._last_attention or layer in self._mamba):
            with self._side():
                if layer == self._last_attention:
                    early.stage_kv(self.cache, request.page_ids, early.num_tokens)
                    early.advance(early.num_tokens, self._recorded())
                if layer in self._mamba:
                    if request.state_slot is None:
                        raise ValueError("the model has Mamba layers but the request holds no state slot")
                    index = self._mamba[layer]
                    views = early.layer_views(index)
                    views["ssm"].copy_(self.cache.ssm_states[request.state_slot, index])
                    views["conv"].copy_(self.cache.conv_states[request.state_slot, index])
                    early.layer_staged(index, self._recorded())
        if layer == self._last_layer and self._stream is not None:
            torch.cuda.current_stream(self._device).wait_stream(self._stream)

    def _side(self) -> torch.cuda.StreamContext | _Now:
        """The side stream, after an event recorded behind the layer just queued (now, on CPU)."""
        if self._stream is None:
            return _Now()
        self._stream.wait_event(torch.cuda.current_stream(self._device).record_event())
        return torch.cuda.stream(self._stream)

    def _recorded(self) -> torch.cuda.Event | None:
        """An event behind the copies queued so far on the side stream (None on CPU: they already ran)."""
        return self._stream.record_event() if self._stream is not None else None


class _Now:
    """A no-op context: on CPU the copies run on the spot."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
