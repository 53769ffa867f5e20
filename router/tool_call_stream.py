"""Streamed tool calls, as OpenAI streams them: a call's first delta carries its index, id, type and
function.name (arguments ""), the following ones fragments of function.arguments, which concatenate to the
arguments' JSON text as the model wrote it. Text before the calls streams as content.

The formats are those of `router.tool_calls`: NemotronH's `<TOOLCALL>[{"name": ..., "arguments": {...}}]
</TOOLCALL>` after optional content, and a generic JSON call object (or list of them) as the whole output (what
the grammar of a forced tool_choice produces). Output that turns out not to be a call (an unknown name, not
JSON) is released as content at the end, as the non-streamed answer would give it.

The call JSON is read by a small resumable scanner here, one character at a time (a generator fed with
`send`), rather than by re-parsing the text so far with a partial-JSON library on every delta: that would be
quadratic in the output, and would give parsed values, not the raw span of `arguments` to forward.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Generator
from typing import Any

_OPEN, _CLOSE = "<TOOLCALL>", "</TOOLCALL>"
_ARGUMENT_KEYS = ("arguments", "parameters")

# a scanner coroutine: receives characters through send(), returns the next unconsumed one (or None at failure)
_Scan = Generator[None, str, Any]


class _Failed(Exception):
    """The text is not a call in a known format (the scanner stops)."""


class ToolCallStream:
    """One chat choice's text in, OpenAI delta dicts out (`feed` per text delta, `finish` at the end)."""

    def __init__(self, names: set[str]) -> None:
        self._names = names
        self._text = ""
        self._content_end = 0  # self._text[:_content_end] was released as content
        self._mode = "start"  # start | content | json | calls | failed | done
        self._scanner: _Scan | None = None
        self._num_calls = 0  # calls whose first delta went out
        self._pending_args: list[str] = []  # arguments text read before the call's name
        self._header_index: int | None = None  # the index of the call being read, once its name is known
        self._deltas: list[dict[str, Any]] = []  # tool_calls entries of the current feed

    @property
    def has_calls(self) -> bool:
        return self._num_calls > 0

    def feed(self, text: str) -> dict[str, Any]:
        """The delta (content and / or tool_calls) these characters release; {} while nothing is known."""
        start = len(self._text)
        self._text += text
        content = ""
        if self._mode == "start":
            stripped = self._text.lstrip()
            if not stripped:
                return {}
            if stripped[0] in "{[":  # held: a call, or (released at the end) JSON content
                self._mode = "json"
                self._start_scanner(len(self._text) - len(stripped))
                return self._delta("")
            self._mode = "content"
        if self._mode == "content":
            content = self._content_until_open()
        elif self._mode in ("json", "calls"):
            self._scan(self._text[start:])
        return self._delta(content)

    def finish(self) -> dict[str, Any]:
        """What is still held: arguments fragments, or the rest of the text as content when no call came."""
        content = self._text[self._content_end :] if self._num_calls == 0 else ""
        self._mode = "done"
        return self._delta(content)

    # ---- content before <TOOLCALL> -----------------------------------------------------------------
    def _content_until_open(self) -> str:
        """Content up to the opening tag (once seen the calls are scanned); a suffix that could begin the tag,
        and trailing whitespace (the non-streamed content is stripped), are held back."""
        found = self._text.find(_OPEN, self._content_end)
        if found >= 0:
            content = self._text[self._content_end : found].rstrip()
            self._content_end += len(content)
            self._mode = "calls"
            self._start_scanner(found + len(_OPEN))
            return content
        end = len(self._text)
        for k in range(min(len(_OPEN) - 1, end - self._content_end), 0, -1):
            if self._text.endswith(_OPEN[:k]):
                end -= k
                break
        end = self._content_end + len(self._text[self._content_end : end].rstrip())
        content = self._text[self._content_end : end]
        self._content_end = end
        return content

    # ---- the call JSON ---------------------------------------------------------------------------
    def _start_scanner(self, at: int) -> None:
        self._scanner = self._calls()
        next(self._scanner)
        self._scan(self._text[at:])

    def _scan(self, chars: str) -> None:
        if self._scanner is None:
            return
        try:
            for ch in chars:
                self._scanner.send(ch)
        except StopIteration:  # all calls read: the rest of the text is ignored, as the non-streamed parser does
            self._scanner = None
        except _Failed:
            self._scanner = None
            if self._num_calls == 0:
                self._mode = "failed"  # released as content at the end

    def _delta(self, content: str) -> dict[str, Any]:
        out: dict[str, Any] = {"content": content} if content else {}
        if self._deltas:
            out["tool_calls"], self._deltas = self._deltas, []
        return out

    def _arguments(self, fragment: str) -> None:
        if not fragment:
            return
        if self._header_index is None:
            self._pending_args.append(fragment)
            return
        last = self._deltas[-1] if self._deltas else None
        if last is not None and last["index"] == self._header_index and "id" not in last:
            last["function"]["arguments"] += fragment
        else:
            self._deltas.append({"index": self._header_index, "function": {"arguments": fragment}})

    def _header(self, name: str) -> None:
        if name not in self._names:
            raise _Failed
        self._header_index = self._num_calls
        self._num_calls += 1
        self._deltas.append({"index": self._header_index, "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                             "function": {"name": name, "arguments": ""}})
        pending, self._pending_args = "".join(self._pending_args), []
        self._arguments(pending)

    def _calls(self) -> _Scan:
        ch = yield from _skip_space((yield))
        listed = ch == "["
        if listed:
            ch = yield from _skip_space((yield))
        while True:
            if ch != "{":
                raise _Failed
            yield from self._call()
            ch = yield from _skip_space((yield))
            if not listed:
                return None
            if ch == ",":
                ch = yield from _skip_space((yield))
                continue
            if ch == "]":
                return None
            raise _Failed

    def _call(self) -> _Scan:
        """One call object, its '{' consumed, through its '}'."""
        self._header_index, self._pending_args = None, []
        ch = yield from _skip_space((yield))
        named = False
        while True:
            if ch != '"':
                raise _Failed
            key = yield from _string()
            ch = yield from _skip_space((yield))
            if ch != ":":
                raise _Failed
            ch = yield from _skip_space((yield))
            if key == "name" and not named:
                if ch != '"':
                    raise _Failed
                self._header((yield from _string()))
                named = True
                ch = yield
            elif key in _ARGUMENT_KEYS:
                ch = yield from _value(ch, self._arguments)
            else:
                ch = yield from _value(ch, None)
            ch = yield from _skip_space(ch)
            if ch == "}":
                if not named:
                    raise _Failed
                return None
            if ch != ",":
                raise _Failed
            ch = yield from _skip_space((yield))


def _skip_space(ch: str) -> _Scan:
    while ch.isspace():
        ch = yield
    return ch


def _string() -> _Scan:
    """A JSON string, its opening quote consumed, through the closing one; its value."""
    raw: list[str] = []
    escaped = False
    while True:
        ch = yield
        if ch == '"' and not escaped:
            try:
                return json.loads(f'"{"".join(raw)}"', strict=False)
            except json.JSONDecodeError:
                raise _Failed from None
        escaped = ch == "\\" and not escaped
        raw.append(ch)


def _value(ch: str, emit: Any) -> _Scan:
    """A JSON value starting with `ch`, its characters passed to `emit` (None: skipped) as read; returns the
    character after it. A string value (arguments given as JSON text) is emitted decoded, in one piece.
    What is emitted is strict JSON: control characters inside strings are escaped."""
    if ch == '"':
        text = yield from _string()
        if emit is not None:
            emit(text if isinstance(text, str) else json.dumps(text))
        return (yield)
    if ch not in "{[":  # a number, true, false or null: up to the next delimiter
        while ch not in ",}]" and not ch.isspace():
            if emit is not None:
                emit(ch)
            ch = yield
        return ch
    depth, in_string, escaped = 0, False, False
    while True:
        if in_string:
            in_string = not (ch == '"' and not escaped)
            escaped = ch == "\\" and not escaped
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        if emit is not None:  # a raw control character in a string (the grammar allows it) goes out escaped
            emit(json.dumps(ch)[1:-1] if in_string and ch < " " else ch)
        if depth == 0:
            return (yield)
        ch = yield
