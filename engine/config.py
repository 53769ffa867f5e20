"""Engine configuration: one frozen dataclass, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class EngineConfig:
    """Knobs of the offline engine and the workers built on it."""

    device: str = "cpu"
    dtype: str = "float32"
    prefill_chunk_size: int = 512  # prefill tokens per step, shared by all prefilling requests
    max_num_seqs: int = 32  # concurrent requests (one Mamba state slot each)
    page_size: int = 16  # tokens per KV page
    max_model_len: int | None = None  # None: the model's max_position_embeddings (or 8192)
    cpu_memory_gb: float = 2.0  # state-cache budget on CPU
    gpu_memory_utilization: float = 0.9  # fraction of GPU memory for weights + state cache
    seed: int = 0  # seeds requests that bring no seed of their own

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        try:
            device = torch.device(self.device)
        except RuntimeError as exc:
            raise ValueError(f"device {self.device!r} is not a torch device: {exc}") from exc
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' was asked for but torch sees no CUDA device; use device='cpu'")
        for name in ("prefill_chunk_size", "max_num_seqs", "page_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.max_model_len is not None and self.max_model_len <= 1:
            raise ValueError(f"max_model_len must be > 1, got {self.max_model_len}")
        if not self.cpu_memory_gb > 0:
            raise ValueError(f"cpu_memory_gb must be > 0, got {self.cpu_memory_gb}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)
