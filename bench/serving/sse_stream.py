"""A streamed POST over a plain asyncio connection, for the serving benchmark's client at high token rates.

httpx's streaming path costs the client ~160 us of CPU per SSE chunk on the CI box (bench/serving/
client_ceiling.py): at 1,024 streams and 16k tokens/s one client process cannot keep up, so the chunks it
timestamps are late and the throughput it reports is its own. Here a response is read in large blocks, de-chunked
and split into SSE events in a loop over bytes (one `read` per block, however many events it holds). HTTP/1.1,
`Connection: close` (one connection per request; the benchmark's requests are long), http:// only.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

_BLOCK = 1 << 16


class HttpError(Exception):
    """A non-200 answer: `status` and the body's first bytes."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"HTTP {status}")
        self.status, self.body = status, body


async def sse_post(url: str, body: dict) -> AsyncIterator[list[bytes]]:
    """POST `body` as JSON to `url` and yield, per block read, the `data:` payloads of the SSE events it
    completed (stripped bytes, in order); HttpError for a non-200 answer, ConnectionError when it breaks off."""
    parts = urlsplit(url)
    if parts.scheme != "http":
        raise ValueError(f"sse_post speaks http:// only, got {url!r}")
    payload = json.dumps(body).encode()
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port or 80, limit=_BLOCK)
    try:
        writer.write(f"POST {parts.path or '/'} HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n"
                     f"Accept: text/event-stream\r\nContent-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
                     .encode() + payload)
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        status = int(lines[0].split()[1])
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(b":") for line in lines[1:] if line)}
        chunked = headers.get(b"transfer-encoding", b"").lower() == b"chunked"
        if status != 200:
            raw = await reader.read() if not chunked else b"".join([p async for p in _dechunk(reader)])
            raise HttpError(status, raw[:2000])
        events = bytearray()
        source = _dechunk(reader) if chunked else _blocks(reader)
        async for data in source:
            events += data
            found: list[bytes] = []
            end = events.rfind(b"\n\n")
            if end < 0:
                continue
            for event in bytes(events[:end]).split(b"\n\n"):
                for line in event.split(b"\n"):
                    if line.startswith(b"data:"):
                        found.append(line[5:].strip())
            del events[: end + 2]
            if found:
                yield found
    finally:
        writer.close()


async def _blocks(reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
    while data := await reader.read(_BLOCK):
        yield data


async def _dechunk(reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
    """The body of a chunked response, one piece per block read (a chunk and its CRLF may span blocks)."""
    buffer = bytearray()
    remaining = 0  # data bytes of the current chunk still to come
    skip = 0  # bytes of the current chunk's closing CRLF still to drop
    while True:
        data = await reader.read(_BLOCK)
        if not data:
            raise ConnectionError("the response ended inside its chunked body")
        buffer += data
        out = bytearray()
        while buffer:
            if skip:
                n = min(skip, len(buffer))
                del buffer[:n]
                skip -= n
                continue
            if remaining == 0:
                line_end = buffer.find(b"\r\n")
                if line_end < 0:
                    break
                size = int(bytes(buffer[:line_end]).split(b";")[0], 16)
                del buffer[: line_end + 2]
                if size == 0:  # the last chunk: the body is complete
                    if out:
                        yield bytes(out)
                    return
                remaining = size
            take = min(remaining, len(buffer))
            out += buffer[:take]
            del buffer[:take]
            remaining -= take
            if remaining == 0:
                skip = 2
        if out:
            yield bytes(out)
