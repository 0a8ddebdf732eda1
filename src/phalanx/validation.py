"""How a config's validation errors are said: one message per bad key, at the key as the user
wrote it (without the tags pydantic adds for a union's members), an unknown key with the nearest
known one, and a union's failed members at one key as one message."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ValidationError

from phalanx.errors import did_you_mean

if TYPE_CHECKING:
    from pydantic_core import ErrorDetails


def said(error: ValidationError, raw: dict, schema: type[BaseModel]) -> str:
    """`error`, raised validating `raw` against `schema`, as one line."""
    return "; ".join(_merge_alternatives([_explain(err, raw, schema) for err in error.errors()]))


def _merge_alternatives(messages: list[str]) -> list[str]:
    """A union's failed members at one key as one message: `parallel.devices: Input should be a
    valid integer or 'auto' (got True)`, not one message per member."""
    merged: list[str] = []
    for message in messages:
        head, sep, rest = message.partition(": Input should be ")
        should, got_sep, got = rest.rpartition(" (got ")
        last, tail = (merged[-1] if merged else ""), got_sep + got
        if sep and got_sep and last.startswith(head + sep) and last.endswith(tail):
            merged[-1] = f"{last[: -len(tail)]} or {should}{tail}"
        else:
            merged.append(message)
    return merged


def _explain(err: ErrorDetails, raw: dict, schema: type[BaseModel]) -> str:
    loc = _user_path(err["loc"], raw)
    where = ".".join(loc) or "config"
    if err["type"] == "extra_forbidden":
        parent = _section_model(schema, loc[:-1])
        choices = parent.model_fields.keys() if parent else []
        close = did_you_mean(loc[-1], choices)
        if close or not choices:
            return f"unknown key {where!r}{close}"
        scope = ".".join(loc[:-1]) or "the config"
        return f"unknown key {where!r}; {scope} takes {', '.join(choices)}"
    if err["type"] == "missing":
        return f"missing key {where!r}: add it to the config"
    got = repr(err.get("input"))
    if err["type"] == "value_error":  # a validator's own message, which may name the value
        said = err["msg"].removeprefix("Value error, ")
        return f"{where}: {said}" if got in said else f"{where}: {said} (got {got})"
    return f"{where}: {err['msg']} (got {got})"


def _user_path(loc: tuple, raw: Any) -> list[str]:
    """The error's location as the user's keys, without the union-member tags pydantic adds."""
    path, node = [], raw
    for part in loc:
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            node = node[part]
        elif isinstance(part, str) and (
            part in _TYPE_TAGS or "[" in part or part.startswith("function-")
        ):
            continue
        else:
            node = None
        path.append(str(part))
    return path


_TYPE_TAGS = {"str", "int", "float", "bool", "none", "list", "dict", "literal"}


def _section_model(schema: type[BaseModel], loc: list[str]) -> type[BaseModel] | None:
    model: type[BaseModel] | None = schema
    for part in loc:
        field = model.model_fields.get(part) if model else None
        if field is None:
            return None
        ann = field.annotation
        args = getattr(ann, "__args__", ())
        model = next(
            (a for a in (ann, *args) if isinstance(a, type) and issubclass(a, BaseModel)), None
        )
    return model
