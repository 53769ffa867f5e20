"""Grammar compilation off the engine loop: size limits refuse what would stall a worker (a 600 x 20 and a
2000 x 20 object schema, an exploding regex, deep nesting) at once and by name; a compile past its deadline is
refused and abandoned; compiled grammars are cached by content with a bound; errors are not cached."""

from __future__ import annotations

import json
import threading
import time

import pytest

from hybridserve.common.sampling_params import StructuredOutput
from hybridserve.engine.grammar_limits import GrammarLimits, regex_states, schema_size
from hybridserve.engine.grammar_pool import GrammarPool
from hybridserve.engine.handoff import CapacityError


def objects_schema(objects: int, properties: int) -> str:
    """The attack's schema: `objects` required objects of `properties` required strings each."""
    inner = {"type": "object", "properties": {f"p{j}": {"type": "string"} for j in range(properties)},
             "required": [f"p{j}" for j in range(properties)]}
    return json.dumps({"type": "object", "properties": {f"o{i}": inner for i in range(objects)},
                       "required": [f"o{i}" for i in range(objects)]})


@pytest.mark.parametrize("objects", [600, 2000])
def test_big_object_schemas_are_refused_before_compiling(objects: int) -> None:
    spec = StructuredOutput("json", objects_schema(objects, 20), field="response_format")
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"response_format: the grammar has \d+ bytes; this server compiles at most"):
        GrammarLimits().check(spec)
    assert time.monotonic() - start < 5  # the check parses once; the compile would take ~15 s / minutes
    with pytest.raises(ValueError, match="object properties"):  # the same schema under a large byte limit
        GrammarLimits(max_spec_bytes=10**8).check(spec)


def test_a_schema_within_the_limits_passes_and_sizes_are_counted() -> None:
    GrammarLimits().check(StructuredOutput("json", objects_schema(95, 20), field="guided_json"))
    assert schema_size(json.loads(objects_schema(3, 4))) == (5, 15)  # root, properties, o0, properties, p0


def test_deep_schemas_and_exploding_regexes_are_refused() -> None:
    deep = "[" * 5000 + "]" * 5000
    with pytest.raises(ValueError, match="guided_json: the schema nests"):
        GrammarLimits().check(StructuredOutput("json", deep, field="guided_json"))
    assert regex_states("((a{100}){100}){100}") == 10**6
    with pytest.raises(ValueError, match="guided_regex: the regex expands to ~1000000 states"):
        GrammarLimits().check(StructuredOutput("regex", "((a{100}){100}){100}", field="guided_regex"))
    GrammarLimits().check(StructuredOutput("regex", r"[a-z]{1,50}@[a-z]+\.com", field="guided_regex"))


def test_a_compile_past_its_deadline_is_refused_and_abandoned() -> None:
    release = threading.Event()

    def slow(spec: StructuredOutput) -> str:
        release.wait(10)
        return "compiled"

    pool = GrammarPool(slow, GrammarLimits(), timeout_s=0.3, threads=1)
    spec = StructuredOutput("regex", "a+", field="guided_regex")
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"guided_regex: the grammar did not compile within 0.3 s"):
        pool.wait(spec)
    assert 0.25 < time.monotonic() - start < 5
    assert pool.num_abandoned == 1
    queued = StructuredOutput("regex", "b+", field="guided_regex")  # behind the running one: cancelled unrun
    outcome: list[BaseException | None] = []
    pool.when_ready(queued, outcome.append)
    deadline = time.monotonic() + 5
    while not outcome and time.monotonic() < deadline:
        time.sleep(0.01)
    assert isinstance(outcome[0], ValueError)
    release.set()
    pool.close()


def test_compiled_grammars_are_cached_by_content_with_a_bound_and_errors_are_not() -> None:
    calls: list[str] = []

    def compile_fn(spec: StructuredOutput) -> str:
        calls.append(spec.spec)
        if spec.spec == "bad":
            raise RuntimeError("syntax error at 0")
        return spec.spec

    pool = GrammarPool(compile_fn, GrammarLimits(), timeout_s=5, threads=1, cache_entries=2)
    specs = [StructuredOutput("regex", p) for p in ("a", "b", "c")]
    for spec in (specs[0], specs[0], specs[1], specs[0], specs[2], specs[1]):
        assert pool.compiled(spec) == spec.spec
    assert calls == ["a", "b", "c", "b"]  # a hit twice; b was the least recently used when c came
    for _ in range(2):
        with pytest.raises(ValueError, match="structured_output does not compile to a grammar: syntax error"):
            pool.compiled(StructuredOutput("regex", "bad"))
    assert calls.count("bad") == 2
    pool.close()


def test_a_full_pool_refuses_with_capacity_error() -> None:
    release = threading.Event()
    pool = GrammarPool(lambda spec: release.wait(10), GrammarLimits(), timeout_s=5, threads=1, max_pending=2)
    outcomes: list[BaseException | None] = []
    for pattern in ("a", "b", "c"):
        pool.when_ready(StructuredOutput("regex", pattern), outcomes.append)
    assert len(outcomes) == 1 and isinstance(outcomes[0], CapacityError)
    release.set()
    pool.close()
