"""Checksums of a state in transit: per-stream digests over chunk crc32c values (host bytes)."""

from __future__ import annotations

import crc32c


class StreamDigest:
    """crc32c over the chunks' crc32c values (little-endian u32, in order): one pass over the data per side."""

    def __init__(self) -> None:
        self.value = 0

    def add(self, chunk_crc: int) -> None:
        self.value = crc32c.crc32c(chunk_crc.to_bytes(4, "little"), self.value)
