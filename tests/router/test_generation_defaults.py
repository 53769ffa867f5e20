"""A checkpoint's generation_config.json sampling defaults (vLLM's --generation-config auto): the router fills what
an HTTP request leaves unset (a value the client sends wins), the gRPC door fills the unset repetition penalty,
`LLM.get_default_sampling_params()` and `generate()` without params use them, and a bad file or setting is a clear
ValueError at start-up."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from router_cluster import MODEL_NAME, Cluster

from hybridserve import LLM, SamplingParams
from hybridserve.common.generation_defaults import GenerationDefaults, load_generation_defaults
from hybridserve.proto import common_pb2, router_pb2, router_pb2_grpc
from hybridserve.router.config import RouterOptions

PROMPT = "Defaults from the checkpoint, please."
PENALTY = 1.6  # strong enough to change the tiny model's greedy tokens
DEFAULTS = {"repetition_penalty": PENALTY, "max_new_tokens": 6, "do_sample": True, "bos_token_id": 0}


@pytest.fixture(scope="module")
def defaults_dir(model_dir: Path, tmp_path_factory) -> Path:
    target = tmp_path_factory.mktemp("gen-defaults") / MODEL_NAME
    shutil.copytree(model_dir, target)
    (target / "generation_config.json").write_text(json.dumps(DEFAULTS))
    return target


@pytest.fixture(scope="module")
def served(defaults_dir: Path):
    c = Cluster(defaults_dir, num_prefill=1, num_decode=1)
    yield c
    c.stop()


@pytest.fixture(scope="module")
def prompt_ids(served: Cluster, defaults_dir: Path) -> list[int]:
    """The prompt followed by its own greedy continuation, so that a repetition penalty changes the next tokens."""
    ids = httpx.post(served.base_url + "/tokenize", json={"model": MODEL_NAME, "prompt": PROMPT}).json()["tokens"]
    return ids + _offline(defaults_dir, ids, max_tokens=6)


def _offline(model_dir: Path, prompt_ids: list[int], **fields) -> list[int]:
    params = SamplingParams(temperature=0.0, ignore_eos=True, **fields)
    return LLM(str(model_dir), generation_config="none").generate(prompt_token_ids=[prompt_ids],
                                                                    sampling_params=params)[0].token_ids


def test_loading_takes_only_the_sampling_keys(defaults_dir: Path, tmp_path: Path) -> None:
    loaded = load_generation_defaults("auto", defaults_dir)
    assert loaded.as_dict() == {"max_tokens": 6, "repetition_penalty": PENALTY}
    assert load_generation_defaults("none", defaults_dir).as_dict() == {}
    assert load_generation_defaults("vllm", defaults_dir).as_dict() == {}
    assert load_generation_defaults(str(defaults_dir), tmp_path).as_dict() == loaded.as_dict()  # a folder
    assert load_generation_defaults("auto", tmp_path).as_dict() == {}  # no file: no defaults
    assert loaded.fill({"repetition_penalty": 1.0})["repetition_penalty"] == 1.0  # the caller wins


@pytest.mark.parametrize(("content", "message"), [
    ("{not json", "not a readable JSON"),
    ("[1, 2]", "JSON object"),
    (json.dumps({"repetition_penalty": 0}), "repetition_penalty"),
    (json.dumps({"temperature": -1}), "temperature"),
    (json.dumps({"top_p": 2}), "top_p"),
])
def test_a_bad_file_is_a_clear_error(tmp_path: Path, content: str, message: str) -> None:
    (tmp_path / "generation_config.json").write_text(content)
    with pytest.raises(ValueError, match=message):
        load_generation_defaults("auto", tmp_path)
    with pytest.raises(ValueError, match=message):
        RouterOptions(str(tmp_path))


def test_a_missing_folder_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no generation_config.json there"):
        RouterOptions(str(tmp_path), generation_config=str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="unknown sampling fields"):
        GenerationDefaults((("beam_width", 2),))


def test_llm_defaults(defaults_dir: Path) -> None:
    llm = LLM(str(defaults_dir))
    assert llm.get_default_sampling_params() == SamplingParams(max_tokens=6, repetition_penalty=PENALTY)
    assert LLM(str(defaults_dir), generation_config="none").get_default_sampling_params() == SamplingParams()
    out = llm.generate([PROMPT])[0]  # no params: the checkpoint's defaults (max_tokens 6)
    assert len(out.token_ids) <= 6


def test_http_fills_what_the_request_leaves_unset(served: Cluster, defaults_dir: Path, prompt_ids: list[int]) -> None:
    client = openai.OpenAI(base_url=served.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    penalised = _offline(defaults_dir, prompt_ids, max_tokens=6, repetition_penalty=PENALTY)
    plain = _offline(defaults_dir, prompt_ids, max_tokens=6)
    assert penalised != plain  # the test can tell the two apart
    out = client.completions.create(model=MODEL_NAME, prompt=prompt_ids, temperature=0,
                                    extra_body={"return_token_ids": True, "ignore_eos": True})
    assert out.choices[0].model_extra["token_ids"] == penalised  # max_tokens 6 and the penalty from the file
    own = client.completions.create(model=MODEL_NAME, prompt=prompt_ids, temperature=0, max_tokens=6,
                                    extra_body={"return_token_ids": True, "ignore_eos": True, "repetition_penalty": 1.0})
    assert own.choices[0].model_extra["token_ids"] == plain  # the client's value wins
    chat = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                          temperature=0, extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == 6
    capped = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                            temperature=0, max_completion_tokens=3, extra_body={"ignore_eos": True})
    assert capped.usage.completion_tokens == 3


def test_grpc_fills_an_unset_repetition_penalty(served: Cluster, defaults_dir: Path, prompt_ids: list[int]) -> None:
    with grpc.insecure_channel(served.router.grpc_address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)

        def run(**extra) -> list[int]:
            sampling = common_pb2.SamplingOptions(max_tokens=6, temperature=0.0, ignore_eos=True, **extra)
            ids: list[int] = []
            request = router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=prompt_ids), sampling=sampling)
            for reply in stub.Generate(request):
                ids += list(reply.event.token_ids)
            return ids

        assert run() == _offline(defaults_dir, prompt_ids, max_tokens=6, repetition_penalty=PENALTY)
        assert run(repetition_penalty=1.0) == _offline(defaults_dir, prompt_ids, max_tokens=6)


def test_no_repeat_ngram_size_is_a_default_on_both_doors(tmp_path: Path) -> None:
    """transformers' generation key beyond vLLM's: loaded from the file, filled into HTTP bodies and gRPC options
    that leave it unset, a client's own value kept."""
    import types

    from hybridserve.proto.convert import sampling_from_proto
    from hybridserve.router.grpc_server import RouterServicer
    from hybridserve.router.openai_protocol import CompletionRequest

    (tmp_path / "generation_config.json").write_text(json.dumps({"no_repeat_ngram_size": 16}))
    defaults = load_generation_defaults("auto", tmp_path).as_dict()
    assert defaults == {"no_repeat_ngram_size": 16}
    body = CompletionRequest(model="m", prompt="x")
    assert body.with_defaults(defaults).no_repeat_ngram_size == 16
    assert CompletionRequest(model="m", prompt="x", no_repeat_ngram_size=0).with_defaults(defaults).no_repeat_ngram_size == 0
    servicer = RouterServicer(types.SimpleNamespace(generation_defaults=defaults))  # type: ignore[arg-type]
    unset = common_pb2.SamplingOptions(max_tokens=4)
    assert servicer._parse_sampling(unset.SerializeToString()).no_repeat_ngram_size == 16
    own = common_pb2.SamplingOptions(max_tokens=4, no_repeat_ngram_size=3)
    assert servicer._parse_sampling(own.SerializeToString()).no_repeat_ngram_size == 3
    assert sampling_from_proto(unset).no_repeat_ngram_size == 0
