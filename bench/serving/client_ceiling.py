"""How many streamed chunks per second the throughput benchmark's client can read (bench/serving/serve_client.py).

    python bench/serving/client_ceiling.py --streams 1024 --tokens 64

A stand-in server in a child process (its own interpreter, so it does not share the client's GIL) answers each
POST /v1/completions with --tokens SSE chunks shaped as the router's (one token id each, then usage and
[DONE]), written for all open streams in rounds as fast as the sockets take them, as a decode step does. The
client is the benchmark's own `stream_completion` at --streams in flight; the result is chunks (= output
tokens) per second and the client process's CPU seconds per 1,000 chunks. If the ceiling is near the served
rate (16k tok/s at 1,024 in flight), the client, not the server, sets the measured throughput.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import resource
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE)]

from serve_client import ClientConfig, stream_completion, stream_completion_raw  # noqa: E402
from serve_metrics import RequestRecord  # noqa: E402


def chunk(index: int, token: int) -> bytes:
    body = {"id": f"cmpl-{index}", "object": "text_completion", "created": 0, "model": "m",
            "choices": [{"index": 0, "text": "", "token_ids": [token], "logprobs": None, "finish_reason": None}]}
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


def serve(port: int, tokens: int, ready: multiprocessing.synchronize.Event) -> None:  # type: ignore[name-defined]
    """The stand-in server: HTTP/1.1 keep-alive, one chunked SSE response per request, rounds over all streams."""

    async def main() -> None:
        writers: list[asyncio.StreamWriter] = []
        wake = asyncio.Event()

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):  # the client closed the connection
                    return
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length")), 0)
                await reader.readexactly(length)
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
                done = asyncio.get_running_loop().create_future()
                writers.append(writer)
                state[writer] = (0, done)
                wake.set()
                await done

        state: dict[asyncio.StreamWriter, tuple[int, asyncio.Future]] = {}

        def send(writer: asyncio.StreamWriter, data: bytes) -> None:
            writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")

        async def rounds() -> None:
            while True:
                await wake.wait()
                wake.clear()
                while state:
                    for writer in list(state):
                        sent, done = state[writer]
                        if sent < tokens:
                            send(writer, chunk(id(writer), 3 + sent % 100))
                            state[writer] = (sent + 1, done)
                        else:
                            usage = {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": tokens}}
                            send(writer, b"data: " + json.dumps(usage).encode() + b"\n\n")
                            send(writer, b"data: [DONE]\n\n")
                            writer.write(b"0\r\n\r\n")
                            del state[writer]
                            done.set_result(None)
                    await asyncio.gather(*(w.drain() for w in list(state)))

        server = await asyncio.start_server(handle, "127.0.0.1", port, backlog=4096)
        asyncio.get_running_loop().create_task(rounds())
        ready.set()
        async with server:
            await server.serve_forever()

    asyncio.run(main())


async def client(port: int, streams: int, tokens: int, transport: str) -> tuple[int, float]:
    import httpx

    cfg = ClientConfig(base_url=f"http://127.0.0.1:{port}", model="m", timeout_s=600)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    records = [RequestRecord(str(i), 0, 1, tokens) for i in range(streams)]
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(600.0)) as http:
        start = time.perf_counter()
        if transport == "raw":
            await asyncio.gather(*(stream_completion_raw(cfg, [1], tokens, r) for r in records))
        else:
            await asyncio.gather(*(stream_completion(http, cfg, [1], tokens, r) for r in records))
        elapsed = time.perf_counter() - start
    failed = [r.error for r in records if not r.success]
    if failed:
        raise SystemExit(f"{len(failed)} streams failed: {failed[0]}")
    return sum(r.output_tokens for r in records), elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, default=1024)
    parser.add_argument("--tokens", type=int, default=64, help="chunks per stream")
    parser.add_argument("--port", type=int, default=18123)
    parser.add_argument("--transport", choices=("raw", "httpx"), default="raw", help="the client's (ClientConfig)")
    args = parser.parse_args()
    ready = multiprocessing.Event()
    server = multiprocessing.Process(target=serve, args=(args.port, args.tokens, ready), daemon=True)
    server.start()
    try:
        ready.wait(30)
        cpu0 = resource.getrusage(resource.RUSAGE_SELF)
        chunks, elapsed = asyncio.run(client(args.port, args.streams, args.tokens, args.transport))
        cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    finally:
        server.terminate()
        server.join(5)
    cpu = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
    print(f"{args.transport}: {args.streams} streams x {args.tokens} chunks: {chunks / elapsed:,.0f} chunks/s, "
          f"client CPU {cpu / chunks * 1e6:.1f} us per chunk ({cpu / elapsed:.2f} cores)")


if __name__ == "__main__":
    main()
