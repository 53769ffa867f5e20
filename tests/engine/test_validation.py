"""Bad input gets a ValueError that says what to change; nothing runs half-way."""

from __future__ import annotations

import pytest
from checkpoints import nemotron_h

from hybridserve import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm() -> LLM:
    model_dir, _ = nemotron_h("M*-M")
    return LLM(model_dir)


def test_empty_prompt(llm: LLM) -> None:
    with pytest.raises(ValueError, match="empty"):
        llm.generate(prompt_token_ids=[[]], sampling_params=SamplingParams(max_tokens=2))


@pytest.mark.parametrize("bad", [128, -1, 10_000])
def test_token_out_of_vocab(llm: LLM, bad: int) -> None:
    with pytest.raises(ValueError, match=r"\[0, 128\)"):
        llm.generate(prompt_token_ids=[[5, bad]], sampling_params=SamplingParams(max_tokens=2))


@pytest.mark.parametrize("bad", [True, 5.0, "7", None])
def test_token_not_an_integer(llm: LLM, bad: object) -> None:
    """bool is an int subclass and a float may equal an int: both are refused, as any non-integer."""
    with pytest.raises(ValueError, match=r"integers in \[0, 128\)"):
        llm.engine.validate_prompt([5, bad, 6])  # type: ignore[list-item]


def test_int_subclasses_in_range_pass(llm: LLM) -> None:
    class TokenId(int):
        pass

    assert llm.engine.validate_prompt([TokenId(3), 4]) == [3, 4]


@pytest.mark.parametrize("max_tokens", [0, -3])
def test_max_tokens_not_positive(max_tokens: int) -> None:
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=max_tokens)


@pytest.mark.parametrize(
    "kwargs, field",
    [({"temperature": -0.5}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
     ({"top_k": -2}, "top_k"), ({"stop_token_ids": [-1]}, "stop_token_ids")],
)
def test_bad_sampling_params(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_prompt_longer_than_model_limit(llm: LLM) -> None:
    with pytest.raises(ValueError, match="max_model_len=512"):
        llm.generate(prompt_token_ids=[[5] * 512], sampling_params=SamplingParams(max_tokens=1))


def test_generation_stops_at_model_limit() -> None:
    model_dir, _ = nemotron_h("M*-M")
    out = LLM(model_dir, max_model_len=12).generate(
        prompt_token_ids=[[5] * 10], sampling_params=SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    )[0]
    assert len(out.token_ids) == 2 and out.finish_reason == "length"


def test_a_bad_prompt_in_a_batch_runs_nothing(llm: LLM) -> None:
    with pytest.raises(ValueError):
        llm.generate(prompt_token_ids=[[5, 6], []], sampling_params=SamplingParams(max_tokens=2))
    assert not llm.engine.has_unfinished()


def test_text_prompt_without_tokenizer(llm: LLM) -> None:
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate(["hello"])


def test_both_or_neither_prompt_kinds(llm: LLM) -> None:
    with pytest.raises(ValueError, match="exactly one"):
        llm.generate()


@pytest.mark.parametrize(
    "kwargs, field",
    [({"dtype": "int8"}, "dtype"), ({"prefill_chunk_size": 0}, "prefill_chunk_size"),
     ({"max_num_seqs": -1}, "max_num_seqs"), ({"bogus": 1}, "bogus"), ({"device": "cuda:0"}, "cuda")],
)
def test_bad_engine_options(kwargs: dict, field: str) -> None:
    model_dir, _ = nemotron_h("M*-M")
    with pytest.raises(ValueError, match=field):
        LLM(model_dir, **kwargs)


def test_missing_model_dir(tmp_path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        LLM(tmp_path / "nope")
