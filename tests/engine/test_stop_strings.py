"""Stop strings matched on the worker (the demo checkpoint, its byte-level BPE tokenizer, CPU, greedy): the
engine finishes a request at the token whose text completes a stop string, the stop chosen from the greedy
output so it is really hit: inside one token, across a token boundary, and across tokens that MTP / n-gram
verification accepted in one step (the rest of that step's accepted tokens are cut). The text ends before
the stop, or after it with include_stop_str_in_output; no tokens are generated past it."""

from __future__ import annotations

import functools

import pytest

from hybridserve import LLM, SamplingParams
from hybridserve.engine.llm_engine import LLMEngine
from hybridserve.models.default_model import default_model_dir

PROMPT = "def add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n"
MAX_TOKENS = 40
OPTIONS = dict(max_model_len=256, max_num_seqs=2)
SPEC = {"mtp": {"method": "mtp", "num_speculative_tokens": 3},
        "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}}


def greedy(**extra: object) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, **extra)  # type: ignore[arg-type]


@functools.cache
def llm(method: str | None) -> LLM:
    return LLM(default_model_dir(), **OPTIONS, **({"speculative_config": SPEC[method]} if method else {}))


def run_steps(engine: LLMEngine, params: SamplingParams) -> tuple[list[int], list[int], str | None, str | None]:
    """One request stepped to the end: its token ids, the tokens each step appended, its text and reason."""
    rid = engine.add_request(engine.encode(PROMPT), params)
    counts, seen = [], 0
    while engine.has_unfinished():
        for out in engine.step():
            assert out.request_id == rid
            counts.append(len(out.token_ids) - seen)
            seen = len(out.token_ids)
            final = out
    return final.token_ids, counts, final.text, final.finish_reason


@functools.cache
def reference() -> tuple[list[int], str, list[str]]:
    """The greedy ids without stops, their full text, and each token's text (each a prefix decode's growth)."""
    engine = llm(None).engine
    ids, _, text, _ = run_steps(engine, greedy())
    pieces = [engine.tokenizer.decode(ids[: i + 1])[len(engine.tokenizer.decode(ids[:i])):] for i in range(len(ids))]
    assert "".join(pieces) == text
    return ids, text or "", pieces


def expected(stop: str) -> tuple[int, str]:
    """Tokens up to (and with) the one whose text completes the first `stop`, and the text before it."""
    ids, text, pieces = reference()
    start = text.find(stop)
    end, length = start + len(stop), 0
    for count, piece in enumerate(pieces, 1):
        length += len(piece)
        if length >= end:
            return count, text[:start]
    raise AssertionError("the stop is in the text")


def first_occurrence(start_token: int, start_char: int, length: int) -> str | None:
    """The stop string starting `start_char` characters into token `start_token`, if it occurs first there."""
    _, text, pieces = reference()
    offset = sum(len(p) for p in pieces[:start_token]) + start_char
    stop = text[offset : offset + length]
    return stop if len(stop) == length and stop.strip() and text.find(stop) == offset else None


def boundary_stop() -> str:
    """A stop string with characters of two tokens: the end of one and the start of the next."""
    _, _, pieces = reference()
    for i in range(3, len(pieces) - 1):
        if len(pieces[i]) >= 2 and len(pieces[i + 1]) >= 2:
            stop = first_occurrence(i, len(pieces[i]) - 2, 4)
            if stop is not None:
                return stop
    raise AssertionError("no two neighbouring tokens of two characters or more")


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_a_token_boundary(include: bool) -> None:
    stop = boundary_stop()
    count, before = expected(stop)
    engine = llm(None).engine
    ids, _, text, reason = run_steps(engine, greedy(stop=(stop,), include_stop_str_in_output=include))
    assert reason == "stop" and ids == reference()[0][:count]  # nothing generated past the stop's last token
    assert text == (before + stop if include else before)
    engine.pool.check()


def test_stop_string_within_one_token_and_the_earliest_of_several() -> None:
    ids_ref, text, pieces = reference()
    i = next(i for i in range(2, len(pieces)) if len(pieces[i].strip()) >= 3 and first_occurrence(i, 0, len(pieces[i])))
    inside = pieces[i]
    later = boundary_stop() if text.find(boundary_stop()) > text.find(inside) else inside
    out = llm(None).generate(PROMPT, greedy(stop=(later, inside, "never-in-the-output")))[0]
    count, before = expected(inside)
    assert out.finish_reason == "stop" and out.token_ids == ids_ref[:count] and out.text == before


@pytest.mark.parametrize("method", ["mtp", "ngram"])
def test_stop_string_across_tokens_accepted_in_one_verify_step(method: str) -> None:
    engine = llm(method).engine
    ids, counts, text, _ = run_steps(engine, greedy())
    ids_ref, text_ref, pieces = reference()
    assert ids == ids_ref  # greedy speculation equals plain greedy decoding
    # a step that appended 3+ tokens (drafts accepted); the stop spans its first two, ending inside the run
    ends = [sum(counts[: k + 1]) for k in range(len(counts))]
    for k in range(1, len(counts)):
        first = ends[k - 1]
        if counts[k] < 3 or not (pieces[first] and pieces[first + 1]):
            continue
        stop = first_occurrence(first, 0, len(pieces[first]) + len(pieces[first + 1]))
        if stop is not None:
            break
    else:
        pytest.fail(f"no step accepted 3 tokens with a fresh stop string in them: {counts}")
    count, before = expected(stop)
    assert count == first + 2 and count not in ends  # the stop ends inside a run that one step accepted
    ids, _, text, reason = run_steps(engine, greedy(stop=(stop,)))
    assert reason == "stop" and ids == ids_ref[:count] and text == before
    engine.pool.check()


def test_stop_strings_need_a_tokenizer_and_non_empty_strings(tmp_path) -> None:
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop=("",))
    from checkpoints import nemotron_h

    bare = LLM(nemotron_h("M*")[0], max_model_len=64)
    with pytest.raises(ValueError, match="stop strings need the model's tokenizer"):
        bare.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=SamplingParams(stop=("x",)))
