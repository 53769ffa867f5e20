"""Index arrays built on the host and sent to the device in one copy, each a 16-byte-aligned view.

Triton specializes a launch on whether each pointer argument is 16-byte aligned. Views into one packed
tensor at arbitrary offsets would be aligned or not depending on the lengths of the arrays before them, so
batches of different shapes would compile new kernel variants while serving (the warm-up cannot cover every
combination). Padding every array to a whole number of 16-byte blocks keeps every view aligned.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

ALIGN_BYTES = 16


def pack_to_device(arrays: Sequence[Sequence[int]], dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """One host->device copy of `arrays` (no host sync); returns one aligned view per array, of its length."""
    per_block = ALIGN_BYTES // torch.empty((), dtype=dtype).element_size()
    packed: list[int] = []
    offsets: list[int] = []
    for values in arrays:
        offsets.append(len(packed))
        packed.extend(values)
        packed.extend([0] * (-len(values) % per_block or (0 if values else per_block)))  # an empty one: a block
    on_device = torch.tensor(packed, dtype=dtype).to(device, non_blocking=True)
    return [on_device[offset : offset + len(values)] for offset, values in zip(offsets, arrays)]
