"""Command-line flags generated from the frozen config dataclasses, and configs built back from parsed flags.

One source of truth: a field's flag is its name with dashes, its type and default are the field's, and its help
is the comment written beside (or just above) the field in the class. Nothing is re-typed in the CLI, so a new
config field is a new flag, and a worker started as a process gets the config whole (`to_json` / `from_json`).
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import io
import json
import re
import tokenize
import types
import typing
from typing import Any, TypeVar

T = TypeVar("T")


def field_comments(cls: type) -> dict[str, str]:
    """field name -> the comment on its line, or the comment lines right above it."""
    comments: dict[str, str] = {}
    pending: list[str] = []
    tokens = tokenize.generate_tokens(io.StringIO(inspect.getsource(cls)).readline)
    line_field: dict[int, str] = {}
    for tok in tokens:
        if tok.type == tokenize.COMMENT:
            text = tok.string.lstrip("#").strip()
            owner = line_field.get(tok.start[0])
            if owner is not None:
                comments[owner] = " ".join(filter(None, [comments.get(owner), text]))
            else:
                pending.append(text)
        elif tok.type == tokenize.NAME and tok.start[1] == 4 and tok.line.strip().startswith(f"{tok.string}:"):
            line_field[tok.start[0]] = tok.string
            if pending:
                comments[tok.string] = " ".join(pending)
            pending = []
        elif tok.type == tokenize.NEWLINE:
            pass
        elif tok.type not in (tokenize.NL, tokenize.INDENT, tokenize.DEDENT):
            if tok.start[0] not in line_field:
                pending = []
    return comments


def user_help(comment: str) -> str:
    """A field comment as `--help` shows it: parentheticals that cite the source checkout's benchmark folders
    are left out (an installed package has no bench/ to look in)."""
    return re.sub(r"\s*\([^()]*\bbench/[^()]*\)", "", comment)


def json_object(text: str) -> dict:
    """argparse type of a flag that takes a JSON object."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def _csv(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def _flag_type(hint: Any) -> tuple[Any, str]:
    """(argparse type, kind) of a field annotation: kind is "bool", "json", "csv" or "scalar"."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    origin = typing.get_origin(hint)
    if hint is bool:
        return None, "bool"
    if origin in (typing.Union, types.UnionType):
        if len(args) == 1:
            return _flag_type(args[0])
        return json_object, "json"  # e.g. SpeculativeConfig | dict | None: given as its JSON
    if origin is tuple:
        return _csv, "csv"
    if origin is dict or hint is dict:
        return json_object, "json"
    if hint in (int, float, str):
        return hint, "scalar"
    raise TypeError(f"no command-line form for a field of type {hint!r}")


def add_config_flags(parser: argparse.ArgumentParser, cls: type, title: str, prefix: str = "",
                     aliases: dict[str, list[str]] | None = None, hidden: frozenset[str] = frozenset()) -> None:
    """One flag per field of dataclass `cls` (`--<prefix><field-name>`), in an argument group `title`;
    `aliases`: extra spellings of a field's flag; `hidden`: fields left at their default without a flag (a
    command they mean nothing to, e.g. serving limits for one offline generation)."""
    group = parser.add_argument_group(title)
    hints = typing.get_type_hints(cls)
    comments = field_comments(cls)
    for f in dataclasses.fields(cls):
        if f.name in hidden:
            continue
        flag_type, kind = _flag_type(hints[f.name])
        default: Any = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
        shown = ",".join(default) if kind == "csv" else default
        help_text = f"{user_help(comments.get(f.name, ''))} (default: {shown})".strip()
        names = [f"--{prefix}{f.name.replace('_', '-')}", *((aliases or {}).get(f.name, []))]
        dest = prefix.replace("-", "_") + f.name
        common: dict[str, Any] = dict(dest=dest, default=default, help=help_text.replace("%", "%%"))
        if kind == "bool":
            group.add_argument(*names, action=argparse.BooleanOptionalAction, **common)
        else:
            group.add_argument(*names, type=flag_type, metavar=f.name.upper(), **common)


def config_from_args(cls: type[T], args: argparse.Namespace, prefix: str = "") -> T:
    """The dataclass built from the flags `add_config_flags` added (its own validation applies)."""
    dest = prefix.replace("-", "_")
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]
    given = {f.name: getattr(args, dest + f.name) for f in fields if hasattr(args, dest + f.name)}
    return cls(**given)


def config_argv(config: Any, prefix: str = "") -> list[str]:
    """The flags `add_config_flags` reads back into `config` (fields left at their default are omitted);
    scalar and bool fields only."""
    argv: list[str] = []
    hints = typing.get_type_hints(type(config))
    for f in dataclasses.fields(config):
        value, kind = getattr(config, f.name), _flag_type(hints[f.name])[1]
        default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
        if value == default:
            continue
        flag = f"--{prefix}{f.name.replace('_', '-')}"
        if kind == "bool":
            argv.append(flag if value else f"--no-{prefix}{f.name.replace('_', '-')}")
        elif kind == "scalar":
            argv += [flag, str(value)]
        else:
            raise TypeError(f"config_argv takes scalar and bool fields; {f.name} is {kind}")
    return argv


def to_jsonable(config: Any) -> dict[str, Any]:
    """A config dataclass as plain JSON values (nested dataclasses as objects, tuples as lists)."""
    return json.loads(json.dumps(dataclasses.asdict(config)))


def from_jsonable(cls: type[T], data: dict[str, Any]) -> T:
    """The inverse of `to_jsonable`; unknown keys are an error that names them."""
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"{cls.__name__} has no field(s) {unknown}")
    hints = typing.get_type_hints(cls)
    values = {k: tuple(v) if typing.get_origin(hints[k]) is tuple and isinstance(v, list) else v for k, v in data.items()}
    return cls(**values)
