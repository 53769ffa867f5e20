"""Size limits on a structured-output grammar, checked before it is compiled.

A grammar's compile time grows with the schema (600 objects x 20 properties take ~15 s of CPU in xgrammar) and
with a regex's expanded size (nested counted repetitions multiply), so a request can cost a worker seconds to
minutes before its first token. These checks are cheap (one JSON parse, one regex parse) and refuse what would
cost too much with a ValueError that names the limit; the compile pool's deadline bounds the rest.
"""

from __future__ import annotations

import importlib
import json
import re
import sys
from dataclasses import dataclass
from typing import Any

from hybridserve.common.sampling_params import StructuredOutput

# Python's own regex parser (re._parser; sre_parse before Python 3.11): for what these limits count, the syntax
# xgrammar takes parses alike there
_regex_parser: Any = importlib.import_module("re._parser" if sys.version_info >= (3, 11) else "sre_parse")

_UNBOUNDED = 65535  # sre's MAXREPEAT and beyond: a loop, one copy of its body


@dataclass(frozen=True)
class GrammarLimits:
    """What a request's grammar may cost before it is compiled (engine config fields of the same names)."""

    max_spec_bytes: int = 256 * 1024  # the JSON schema / regex text, UTF-8 bytes
    max_properties: int = 2048  # object properties over the whole schema (each compiles to grammar rules)
    max_depth: int = 64  # nesting of the schema's JSON objects and arrays
    max_regex_states: int = 10_000  # a regex's size with its counted repetitions expanded, e.g. a{100}: 100

    def __post_init__(self) -> None:
        for name in ("max_spec_bytes", "max_properties", "max_depth", "max_regex_states"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

    def check(self, spec: StructuredOutput) -> None:
        """ValueError naming the field and the limit when `spec` is beyond one."""
        texts = [spec.spec] if spec.kind in ("json", "regex") else list(spec.choices)
        size = sum(len(t.encode("utf-8", "surrogatepass")) for t in texts)
        if size > self.max_spec_bytes:
            raise ValueError(f"{spec.field}: the grammar has {size} bytes; this server compiles at most "
                             f"{self.max_spec_bytes} (a smaller schema or pattern)")
        if spec.kind == "json":
            self._check_schema(spec)
        elif spec.kind == "regex":
            states = regex_states(spec.spec)
            if states > self.max_regex_states:
                raise ValueError(f"{spec.field}: the regex expands to ~{states} states with its repetitions "
                                 f"counted; this server compiles at most {self.max_regex_states}")

    def _check_schema(self, spec: StructuredOutput) -> None:
        try:
            schema = json.loads(spec.spec)
        except RecursionError:
            raise ValueError(f"{spec.field}: the schema nests deeper than {self.max_depth} levels") from None
        except ValueError as exc:
            raise ValueError(f"{spec.field} is not valid JSON: {exc}") from None
        depth, properties = schema_size(schema)
        if depth > self.max_depth:
            raise ValueError(f"{spec.field}: the schema nests {depth} levels deep; this server compiles at most "
                             f"{self.max_depth}")
        if properties > self.max_properties:
            raise ValueError(f"{spec.field}: the schema has {properties} object properties; this server compiles "
                             f"at most {self.max_properties} (split it, or constrain fewer fields)")


def schema_size(schema: Any) -> tuple[int, int]:
    """(nesting depth, number of object properties) of a parsed JSON schema, walked without recursion."""
    depth = properties = 0
    stack: list[tuple[Any, int]] = [(schema, 1)]
    while stack:
        node, level = stack.pop()
        if isinstance(node, dict):
            depth = max(depth, level)
            props = node.get("properties")
            if isinstance(props, dict):
                properties += len(props)
            stack.extend((v, level + 1) for v in node.values() if isinstance(v, (dict, list)))
        elif isinstance(node, list):
            depth = max(depth, level)
            stack.extend((v, level + 1) for v in node if isinstance(v, (dict, list)))
    return depth, properties


def regex_states(pattern: str) -> int:
    """An upper estimate of a regex's automaton size: literal and class items count 1, alternatives and groups
    add up, a counted repetition multiplies its body by its bound (an unbounded one counts its minimum, at least
    once). A pattern Python cannot parse counts its length (xgrammar then reports the syntax error)."""
    try:
        parsed = _regex_parser.parse(pattern)
    except (re.error, RecursionError, OverflowError, ValueError):
        return len(pattern)
    return _size(parsed)


def _size(items: Any) -> int:
    total = 0
    for op, arg in items:
        name = str(op)
        if name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"):
            low, high, body = arg
            times = high if high < _UNBOUNDED else max(low, 1)
            total += max(times, 1) * _size(body)
        elif name == "SUBPATTERN":
            total += _size(arg[-1])
        elif name == "BRANCH":
            total += sum(_size(b) for b in arg[1])
        elif name in ("ASSERT", "ASSERT_NOT", "ATOMIC_GROUP"):
            total += _size(arg[-1] if isinstance(arg, tuple) else arg)
        else:
            total += 1
    return total
