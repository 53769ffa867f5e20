"""The checks both front doors run on a request (HTTP and gRPC call the same functions), raising ApiError 400
with an OpenAI-style message that names the parameter (gRPC answers it as INVALID_ARGUMENT).

Beyond what SamplingParams checks on construction: stop strings bounded in number and length (each is matched
against the output on every token), numbers finite and in the OpenAI API's ranges, text that is valid Unicode
(a lone surrogate cannot be encoded, and a tokenizer fails on it), request ids of bounded size (they are logged
and echoed), and request bodies parsed as JSON with bounded nesting.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from hybridserve.common.sampling_params import SamplingParams
from hybridserve.router.openai_protocol import MAX_STOP_STRINGS, ApiError

MAX_STOP_CHARS = 1024  # characters per stop string
MAX_REQUEST_ID_BYTES = 256
MAX_TEMPERATURE = 2.0  # OpenAI's range, [0, 2]
MAX_JSON_DEPTH = 128  # nesting of a request body's objects and arrays
# an escaped UTF-16 surrogate in JSON text: checked exactly (on the parsed strings) only when one appears
_ESCAPED_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def check_request_id(label: str, param: str = "request_id") -> str:
    """A client's request id: at most MAX_REQUEST_ID_BYTES bytes of valid Unicode."""
    check_text(label, param)
    if len(label.encode("utf-8")) > MAX_REQUEST_ID_BYTES:
        raise ApiError(400, f"{param} has {len(label.encode('utf-8'))} bytes; at most {MAX_REQUEST_ID_BYTES}",
                       param=param)
    return label


def check_text(text: str, param: str) -> None:
    """Text the tokenizer can take: no lone UTF-16 surrogates (they have no UTF-8 encoding)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ApiError(400, f"{param} contains a lone UTF-16 surrogate ({text[exc.start]!a} at character "
                            f"{exc.start}), which is not valid Unicode text", param=param) from None


def check_sampling(params: SamplingParams) -> None:
    """What SamplingParams allows but a server must not take from a client."""
    if len(params.stop) > MAX_STOP_STRINGS:
        raise ApiError(400, f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(params.stop)}", param="stop")
    for stop in params.stop:
        check_text(stop, "stop")
        if len(stop) > MAX_STOP_CHARS:
            raise ApiError(400, f"a stop string has {len(stop)} characters; at most {MAX_STOP_CHARS}", param="stop")
    if not (math.isfinite(params.temperature) and 0.0 <= params.temperature <= MAX_TEMPERATURE):
        raise ApiError(400, f"temperature must be a number in [0, {MAX_TEMPERATURE:g}], got {params.temperature}",
                       param="temperature")
    for name in ("top_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        if not math.isfinite(getattr(params, name)):
            raise ApiError(400, f"{name} must be a finite number, got {getattr(params, name)}", param=name)
    if any(not math.isfinite(bias) for _, bias in params.logit_bias):
        raise ApiError(400, "logit_bias values must be finite numbers", param="logit_bias")
    if params.structured is not None:
        for text in (params.structured.spec, *params.structured.choices):
            check_text(text, params.structured.field)


def parse_json_body(raw: bytes | bytearray) -> Any:
    """A request body as JSON: ApiError 400 for malformed JSON, NaN / Infinity, nesting deeper than
    MAX_JSON_DEPTH, or strings with lone surrogates."""
    try:
        data = json.loads(raw, parse_constant=_no_constant)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise ApiError(400, f"the request body nests JSON deeper than {MAX_JSON_DEPTH} levels") from None
    # the parser's own guard stops at the interpreter's recursion limit; the bracket count bounds the depth
    if raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH and isinstance(data, (dict, list)) \
            and _depth(data) > MAX_JSON_DEPTH:
        raise ApiError(400, f"the request body nests JSON deeper than {MAX_JSON_DEPTH} levels")
    if _ESCAPED_SURROGATE.search(raw):
        _check_strings(data)
    return data


def _no_constant(name: str) -> float:
    raise ApiError(400, f"the request body is not valid JSON: {name} is not a JSON number")


def _depth(data: Any) -> int:
    """The deepest nesting of objects and arrays in parsed JSON, walked without recursion."""
    deepest = 0
    stack = [(data, 1)]
    while stack:
        node, level = stack.pop()
        deepest = max(deepest, level)
        if deepest > MAX_JSON_DEPTH:
            break
        children = node.values() if isinstance(node, dict) else node
        stack.extend((child, level + 1) for child in children if isinstance(child, (dict, list)))
    return deepest


def _check_strings(data: Any) -> None:
    stack: list[tuple[Any, str]] = [(data, "")]
    while stack:
        node, path = stack.pop()
        if isinstance(node, str):
            check_text(node, path or "body")
        elif isinstance(node, dict):
            for key, value in node.items():
                check_text(key, path or "body")
                stack.append((value, f"{path}.{key}" if path else key))
        elif isinstance(node, list):
            stack.extend((value, f"{path}[{i}]") for i, value in enumerate(node))
