"""Checksums of a state in transit: gRPC stream digests over chunk crc32c values (host bytes) and a device
digest of the whole staged state (computed on the GPU on both ends of every plane)."""

from __future__ import annotations

import crc32c
import numpy as np
import torch


class StreamDigest:
    """crc32c over the chunks' crc32c values (little-endian u32, in order): one pass over the data per side."""

    def __init__(self) -> None:
        self.value = 0

    def add(self, chunk_crc: int) -> None:
        self.value = crc32c.crc32c(chunk_crc.to_bytes(4, "little"), self.value)


_DIGEST_ROW_WORDS = 4096  # words per row of the 2-D view the digest sums over


def device_digest(data: torch.Tensor) -> int:
    """A 64-bit position-sensitive checksum of a flat uint8 tensor, computed where the bytes live (on the GPU
    for device planes: no host copy). Not cryptographic: it catches corruption, truncation and reordering.

    The bytes are read as int32 words in rows of 4096; the digest mixes the total, the row sums weighted by
    row number and the column sums weighted by column number (all int64, wrapping, so the reduction order of
    the device does not matter).
    """
    if data.dtype != torch.uint8 or data.dim() != 1:
        raise ValueError(f"device_digest takes a flat uint8 tensor, got {data.dtype} {tuple(data.shape)}")
    nbytes = data.numel()
    whole = nbytes - nbytes % 4
    words = data[:whole].view(torch.int32)  # storage offsets of staged states are 256-byte aligned
    tail = int.from_bytes(bytes(data[whole:].tolist()), "little") if whole != nbytes else 0
    full = words.numel() // _DIGEST_ROW_WORDS
    grid = words[: full * _DIGEST_ROW_WORDS].view(full, _DIGEST_ROW_WORDS)  # [rows, 4096], no copy
    rest = words[full * _DIGEST_ROW_WORDS :]  # the short last row
    if grid.device.type == "cpu":  # numpy's int32 -> int64 sums run ~15x faster than torch's on the CPU
        host = grid.numpy()  # exact integer sums either way (no overflow: < 2^48), so the digest is the same
        row_sums = torch.from_numpy(host.sum(axis=1, dtype=np.int64))  # [rows]
        col_sums = torch.from_numpy(host.sum(axis=0, dtype=np.int64))  # [4096]
    else:
        row_sums = grid.sum(dim=1, dtype=torch.int64)  # [rows]
        col_sums = grid.sum(dim=0, dtype=torch.int64)  # [4096]
    if rest.numel():  # as if zero-padded to a whole row
        last = torch.zeros(_DIGEST_ROW_WORDS, dtype=torch.int64, device=data.device)
        last[: rest.numel()] = rest
        row_sums = torch.cat([row_sums, last.sum().view(1)])
        col_sums = col_sums + last
    rows = row_sums.numel()
    row_weights = torch.arange(1, rows + 1, dtype=torch.int64, device=data.device)
    col_weights = torch.arange(1, _DIGEST_ROW_WORDS + 1, dtype=torch.int64, device=data.device) * 0x9E3779B1
    mixed = torch.stack([row_sums.sum(), (row_sums * row_weights).sum(), (col_sums * col_weights).sum()])
    total, by_row, by_col = (int(v) for v in mixed.tolist())  # one device->host sync
    value = (total * 0x100000001B3) ^ (by_row * 0xC2B2AE3D27D4EB4F) ^ by_col ^ (tail << 7) ^ nbytes
    return value & 0xFFFFFFFFFFFFFFFF
