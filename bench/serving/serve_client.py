"""The async HTTP client of the serving benchmark: streams `/v1/completions`, times every chunk, runs sessions
at their arrival offsets under a concurrency limit, and scrapes Prometheus counters before and after."""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import httpx
from serve_metrics import RequestRecord, counters_delta, parse_counters
from serve_workloads import Session
from sse_stream import HttpError, sse_post


@dataclass
class ClientConfig:
    """How requests are sent."""

    base_url: str
    model: str
    endpoint: str = "/v1/completions"
    temperature: float = 0.0
    ignore_eos: bool = True
    extra_body: dict = field(default_factory=dict)
    timeout_s: float = 600.0
    max_concurrency: int | None = None
    token_range: tuple[int, int] = (3, 256)  # filler answers when the server returns no token ids
    seed: int = 0
    # "raw": streams over plain asyncio connections (sse_stream.py), which keep up with 1,024 streams at 16k
    # tokens/s where httpx's streaming cost the client ~160 us per chunk; "httpx" otherwise (and for https)
    transport: str = "raw"


def request_body(cfg: ClientConfig, prompt: list[int], max_tokens: int) -> dict:
    """The streamed completion request of one turn (token-id prompt, usage in the last chunk)."""
    body = {"model": cfg.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": cfg.temperature,
            "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    body.update(cfg.extra_body)
    return body


def _error_text(status: int, raw: bytes) -> str:
    """`HTTP <status>: <OpenAI error message>` (or the first bytes of a body that is not one)."""
    try:
        message = json.loads(raw)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = raw[:200].decode("utf-8", "replace")
    return f"HTTP {status}: {message}"


class _Stream:
    """One streamed answer as its chunks arrive: tokens, times, usage (shared by both transports)."""

    def __init__(self, record: RequestRecord) -> None:
        self.record = record
        self.answer: list[int] = []
        self.n_chunk_tokens = 0
        self.usage: dict | None = None
        self.start = time.perf_counter()
        self.last = self.start

    def payload(self, payload: str | bytes, now: float) -> bool:
        """Take one `data:` payload received at `now`; False at the end of the stream ([DONE] or an error)."""
        if payload in ("[DONE]", b"[DONE]"):
            return False
        record = self.record
        obj = json.loads(payload)
        if "error" in obj:
            record.error = f"stream error: {obj['error'].get('message', obj['error'])}"
            return False
        if obj.get("usage"):
            self.usage = obj["usage"]
        for choice in obj.get("choices") or []:
            ids = choice.get("token_ids") or []
            text = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
            if choice.get("finish_reason"):
                record.finish_reason = choice["finish_reason"]
            if not ids and not text:
                continue
            self.answer.extend(ids)
            self.n_chunk_tokens += len(ids) if ids else 1
            if record.ttft is None:
                record.ttft = now - self.start
            else:
                record.itl.append(now - self.last)
            self.last = now
        return True

    def finish(self) -> list[int]:
        record = self.record
        if record.error is not None:
            return self.answer
        record.e2e = time.perf_counter() - self.start
        if self.usage is not None:
            record.output_tokens = int(self.usage.get("completion_tokens", self.n_chunk_tokens))
            details = self.usage.get("prompt_tokens_details") or {}
            record.cached_tokens = details.get("cached_tokens")
            record.prompt_len = int(self.usage.get("prompt_tokens", record.prompt_len))
        else:
            record.output_tokens = self.n_chunk_tokens
        if record.ttft is None:
            record.error = "no tokens streamed"
            return self.answer
        record.success = True
        return self.answer


async def stream_completion(client: httpx.AsyncClient, cfg: ClientConfig, prompt: list[int], max_tokens: int,
                            record: RequestRecord) -> list[int]:
    """Send one streamed request through httpx, filling `record` (times from the send); returns the answer's
    token ids."""
    stream = _Stream(record)
    try:
        body = request_body(cfg, prompt, max_tokens)
        async with client.stream("POST", cfg.base_url + cfg.endpoint, json=body) as resp:
            if resp.status_code != 200:
                record.error = _error_text(resp.status_code, await resp.aread())
                return stream.answer
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                if not stream.payload(line[5:].strip(), time.perf_counter()):
                    break
    except (httpx.HTTPError, ValueError, asyncio.TimeoutError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"[:200] if str(exc) else type(exc).__name__
        return stream.answer
    return stream.finish()


async def stream_completion_raw(cfg: ClientConfig, prompt: list[int], max_tokens: int,
                                record: RequestRecord) -> list[int]:
    """`stream_completion` over a plain asyncio connection (sse_stream.py); every event of one read gets the
    read's time (they arrived together)."""
    stream = _Stream(record)
    try:
        async with asyncio.timeout(cfg.timeout_s):
            async for payloads in sse_post(cfg.base_url + cfg.endpoint, request_body(cfg, prompt, max_tokens)):
                now = time.perf_counter()
                if not all(stream.payload(p, now) for p in payloads):
                    break
    except HttpError as exc:
        record.error = _error_text(exc.status, exc.body)
        return stream.answer
    except (OSError, ValueError, asyncio.TimeoutError, asyncio.IncompleteReadError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"[:200] if str(exc) else type(exc).__name__
        return stream.answer
    return stream.finish()


async def run_sessions(cfg: ClientConfig, sessions: list[Session], offsets: list[float]
                       ) -> tuple[list[RequestRecord], float]:
    """Run every session from its offset; returns the records (arrival order) and the wall time in seconds."""
    sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    records: list[RequestRecord] = []
    filler = random.Random(cfg.seed + 1)
    raw = cfg.transport == "raw" and cfg.base_url.startswith("http://")
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(cfg.timeout_s, connect=min(30.0, cfg.timeout_s))
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        t0_perf = time.perf_counter()
        end = [t0_perf]

        async def one(session: Session, offset: float) -> None:
            await asyncio.sleep(max(0.0, t0 + offset - loop.time()))
            history = list(session.prefix_token_ids)
            for k, turn in enumerate(session.turns):
                prompt = history + turn.new_token_ids
                rec = RequestRecord(session.session_id, k, len(prompt), turn.max_tokens, group=session.group)
                records.append(rec)
                if sem is not None:
                    await sem.acquire()
                try:
                    rec.start = time.perf_counter() - t0_perf
                    if raw:
                        answer = await stream_completion_raw(cfg, prompt, turn.max_tokens, rec)
                    else:
                        answer = await stream_completion(client, cfg, prompt, turn.max_tokens, rec)
                finally:
                    if sem is not None:
                        sem.release()
                end[0] = max(end[0], time.perf_counter())
                if not rec.success:
                    for j in range(k + 1, len(session.turns)):  # later turns need this one's answer
                        records.append(RequestRecord(session.session_id, j, 0, session.turns[j].max_tokens,
                                                     error="skipped: an earlier turn failed", group=session.group))
                    return
                if len(answer) != rec.output_tokens:  # no token ids streamed: stand-in ids of the right length
                    lo, hi = cfg.token_range
                    answer = [filler.randrange(lo, hi) for _ in range(rec.output_tokens)]
                history = prompt + answer

        await asyncio.gather(*(one(s, o) for s, o in zip(sessions, offsets)))
    return records, end[0] - t0_perf


async def metrics_urls(base_url: str, extra: list[str]) -> list[str]:
    """Every component's /metrics from the router's http_sd `/targets` (else the server's own), plus `extra`."""
    urls: list[str] = []
    try:
        async with httpx.AsyncClient(timeout=10.0) as client:
            resp = await client.get(base_url + "/targets")
            if resp.status_code == 200:
                for group in resp.json():
                    urls += [f"http://{t}/metrics" for t in group.get("targets", [])]
    except (httpx.HTTPError, ValueError, TypeError, AttributeError):
        urls = []
    if not urls:
        urls = [base_url + "/metrics"]
    return urls + [u for u in extra if u not in urls]


async def metrics_texts(urls: list[str]) -> list[str]:
    """The Prometheus text of every URL in `urls` that answers 200 (the others are left out)."""
    texts = []
    async with httpx.AsyncClient(timeout=10.0) as client:
        for url in urls:
            try:
                resp = await client.get(url)
            except httpx.HTTPError:
                continue
            if resp.status_code == 200:
                texts.append(resp.text)
    return texts


async def scrape(urls: list[str]) -> dict[str, float] | None:
    """Summed benchmark counters over `urls` (None when no URL answered)."""
    texts = await metrics_texts(urls)
    total: dict[str, float] = {}
    for text in texts:
        for k, v in parse_counters(text).items():
            total[k] = total.get(k, 0.0) + v
    return total if texts else None


async def run_with_metrics(cfg: ClientConfig, sessions: list[Session], offsets: list[float], urls: list[str] | None
                           ) -> tuple[list[RequestRecord], float, dict[str, float] | None]:
    """`run_sessions` between two scrapes of `urls` (None: no scraping); returns the counter deltas too."""
    before = await scrape(urls) if urls else None
    records, duration = await run_sessions(cfg, sessions, offsets)
    after = await scrape(urls) if urls else None
    delta = counters_delta(before, after) if before is not None and after is not None else None
    return records, duration, delta


async def server_info(base_url: str) -> dict:
    """The served model's id and context length from `/v1/models`; raises ConnectionError when unreachable."""
    try:
        async with httpx.AsyncClient(timeout=10.0) as client:
            resp = await client.get(base_url + "/v1/models")
            resp.raise_for_status()
            model = resp.json()["data"][0]
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as exc:
        raise ConnectionError(f"cannot read {base_url}/v1/models: {type(exc).__name__}: {exc}") from exc
    return {"model": model["id"], "max_model_len": model.get("max_model_len")}
