"""What a multiplexed engine's steps ran (engine/multiplex.py), for a worker's metrics: requests handed from the
prefill lane to the decode lane, steps that overlapped, steps on the whole GPU, and each lane's work by the SMs it
ran on (a whole-GPU step's work under the device's SM count)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from hybridserve.engine.sm_partition import SmSplit


@dataclass
class LaneCounters:
    """Counts since start-up (or the last `reset`); the by-SMs maps hold every SM count a lane can run on from the
    start, so that each metric series exists at 0."""

    handoffs: int = 0  # requests whose prompt finished in the prefill lane and passed to the decode lane
    overlapped_steps: int = 0  # decode steps launched while a prefill forward was in flight
    prefills_beside_decode: int = 0  # prefill forwards launched while a decode step ran
    whole_gpu_steps: int = 0  # co-located steps on the whole GPU (one phase idle, or a backlog draining)
    prefill_tokens_by_sms: dict[int, int] = field(default_factory=dict)  # SMs -> prompt tokens run there
    decode_rows_by_sms: dict[int, int] = field(default_factory=dict)  # SMs -> decode rows run there

    @classmethod
    def for_menu(cls, splits: Iterable[SmSplit], total_sms: int) -> LaneCounters:
        """Counters whose by-SMs maps start with every lane SM count of the menu and the whole device's."""
        splits = tuple(splits)
        return cls(prefill_tokens_by_sms=dict.fromkeys(sorted({*(s.prefill_sms for s in splits), total_sms}), 0),
                   decode_rows_by_sms=dict.fromkeys(sorted({*(s.decode_sms for s in splits), total_sms}), 0))

    def as_stats(self) -> dict[str, Any]:
        """The counters as a worker's stats (copies of the maps)."""
        return {"handoffs": self.handoffs, "overlapped_steps": self.overlapped_steps,
                "prefills_beside_decode": self.prefills_beside_decode, "whole_gpu_steps": self.whole_gpu_steps,
                "prefill_tokens_by_sms": dict(self.prefill_tokens_by_sms),
                "decode_rows_by_sms": dict(self.decode_rows_by_sms)}

    def reset(self) -> None:
        """Zero every count, keeping the maps' keys (the start-up profile's work is not the load's)."""
        self.handoffs = self.overlapped_steps = self.prefills_beside_decode = self.whole_gpu_steps = 0
        for counts in (self.prefill_tokens_by_sms, self.decode_rows_by_sms):
            counts.update(dict.fromkeys(counts, 0))
