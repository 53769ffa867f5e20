"""The benchmark's raw SSE transport: chunked bodies split anywhere, error answers, and the same record as httpx."""

from __future__ import annotations

import asyncio
import json

from serve_client import ClientConfig, stream_completion_raw
from serve_metrics import RequestRecord


def _events(n: int) -> bytes:
    out = b""
    for i in range(n):
        out += b"data: " + json.dumps({"choices": [{"text": "x", "token_ids": [10 + i], "finish_reason": None}]}).encode()
        out += b"\n\n"
    out += b'data: {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": %d}}\n\n' % n
    return out + b"data: [DONE]\n\n"


async def _serve(status: int, body: bytes, piece: int) -> tuple[asyncio.AbstractServer, int]:
    """A server answering one POST with `body` in HTTP chunks of 7 bytes, written `piece` bytes at a time."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(x.split(b":")[1]) for x in head.split(b"\r\n") if x.lower().startswith(b"content-length"))
        await reader.readexactly(length)
        wire = b"".join(b"%x\r\n%s\r\n" % (len(body[i : i + 7]), body[i : i + 7]) for i in range(0, len(body), 7))
        wire = (b"HTTP/1.1 %d X\r\ntransfer-encoding: chunked\r\n\r\n" % status) + wire + b"0\r\n\r\n"
        for i in range(0, len(wire), piece):
            writer.write(wire[i : i + piece])
            await writer.drain()
            await asyncio.sleep(0)
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


def test_raw_transport_reads_split_chunks() -> None:
    async def run(piece: int) -> tuple[list[int], RequestRecord]:
        server, port = await _serve(200, _events(5), piece)
        async with server:
            record = RequestRecord("s", 0, 4, 5)
            answer = await stream_completion_raw(ClientConfig(base_url=f"http://127.0.0.1:{port}", model="m"),
                                                 [1, 2, 3, 4], 5, record)
            return answer, record

    for piece in (1, 3, 4096):
        answer, record = asyncio.run(run(piece))
        assert answer == [10, 11, 12, 13, 14], piece
        assert record.success and record.output_tokens == 5 and record.ttft is not None


def test_raw_transport_reports_an_error_answer() -> None:
    async def run() -> RequestRecord:
        server, port = await _serve(400, b'{"error": {"message": "bad prompt"}}', 5)
        async with server:
            record = RequestRecord("s", 0, 4, 5)
            await stream_completion_raw(ClientConfig(base_url=f"http://127.0.0.1:{port}", model="m"), [1], 5, record)
            return record

    record = asyncio.run(run())
    assert not record.success and record.error == "HTTP 400: bad prompt"
