"""Stop strings over a disaggregated server (1 prefill + 1 decode worker, the tiny byte-tokenizer checkpoint):
the decode worker ends the request at the token completing the stop (seen through the orchestrator, with no
router text stream trimming anything), including a stop completed by the first token (sampled on the prefill
worker) and one spanning that token and the next; through HTTP the text ends before the stop, or after it with
include_stop_str_in_output, streamed and not; the gRPC front door honours them too."""

from __future__ import annotations

import functools

import grpc
import pytest
from router_cluster import MODEL_NAME

from hybridserve import SamplingParams
from hybridserve.common.tokenizer import Tokenizer
from hybridserve.proto import router_pb2, router_pb2_grpc
from hybridserve.proto.convert import sampling_to_proto

PROMPT = "The quick brown fox jumps over the lazy dog, again and again."
MAX_TOKENS = 24


def greedy(**extra: object) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, **extra)  # type: ignore[arg-type]


@functools.cache
def _tokenizer(model_dir) -> Tokenizer:
    return Tokenizer(model_dir)


def stops_and_counts(model_dir, ids: list[int]) -> list[tuple[str, int, str]]:
    """(stop, tokens up to the one completing it, text before it) for: the first token's text, the first two
    tokens' text, and a printable 2-character string later on, each where it first occurs."""
    tok = _tokenizer(model_dir)
    prefixes = [tok.decode(ids[:n]) for n in range(len(ids) + 1)]
    text = prefixes[-1]
    candidates = [prefixes[1], prefixes[2]]
    later = [text[i : i + 2] for i in range(4, len(text) - 1)]
    candidates += [s for s in later if s.isascii() and s.isprintable()][:1]
    cases = []
    for stop in candidates:
        assert stop and "\ufffd" not in stop, f"pick another prompt: the greedy text starts {text[:4]!r}"
        start = text.find(stop)
        count = next(n for n, p in enumerate(prefixes) if p.find(stop) >= 0)
        cases.append((stop, count, text[:start]))
    return cases


def test_the_decode_worker_stops_at_the_stop_string(cluster, model_dir) -> None:
    prompt = _tokenizer(model_dir).encode(PROMPT)
    ids = cluster.generate(prompt, greedy())
    assert len(ids) == MAX_TOKENS
    for stop, count, _ in stops_and_counts(model_dir, ids):
        events = list(cluster.orchestrator.generate(prompt, greedy(stop=(stop,))))
        assert [t for e in events for t in e.token_ids] == ids[:count], stop
        assert events[-1].finish_reason == "stop"
    assert {d.reason for _, d in cluster.orchestrator.recent_decisions} <= {"prefill_least_cost", "prefill_cached_prefix"}
    assert cluster.idle()
    cluster.check_pools()


@pytest.mark.parametrize("include", [False, True])
def test_http_text_ends_at_the_stop(client, model_dir, include: bool) -> None:
    whole = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                      extra_body={"ignore_eos": True, "return_token_ids": True})
    ids = whole.choices[0].model_extra["token_ids"]
    for stop, count, before in stops_and_counts(model_dir, ids):
        extra = {"ignore_eos": True, "return_token_ids": True, "include_stop_str_in_output": include}
        out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                        stop=[stop, "not in this output"], extra_body=extra)
        choice = out.choices[0]
        assert choice.finish_reason == "stop" and choice.text == (before + stop if include else before)
        assert choice.model_extra["token_ids"] == ids[:count] and out.usage.completion_tokens == count
        chunks = list(client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                                stop=stop, stream=True, extra_body=extra))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_grpc_front_door_cuts_at_the_stop(cluster, model_dir) -> None:
    prompt_ids = _tokenizer(model_dir).encode(PROMPT)
    stop, count, before = stops_and_counts(model_dir, cluster.generate(prompt_ids, greedy()))[-1]
    stub = router_pb2_grpc.RouterStub(grpc.insecure_channel(cluster.router.grpc_address))
    sampling = sampling_to_proto(greedy(stop=(stop,), include_stop_str_in_output=True))
    replies = list(stub.Generate(router_pb2.GenerateRequest(text=PROMPT, sampling=sampling), timeout=60))
    assert "".join(r.text_delta for r in replies) == before + stop
    assert sum(len(r.event.token_ids) for r in replies) == count and replies[-1].event.finish_reason == "stop"
