"""Command-line overrides of a config: `KEY=VALUE` sets, `+KEY=VALUE` appends or adds, `~KEY`
deletes.

Keys are dotted paths. In a list, an item is named by its index (`hooks.3`) or, where the list's
items are a name or a one-key mapping as hooks are, by that name: `hooks.StopAfter.epochs=30` is
`hooks.<i>.StopAfter.epochs=30` for the one StopAfter in the list. A config that lists no hooks
runs the default ones; an override that edits `hooks` edits that default list.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import yaml

from phalanx.errors import ConfigError
from phalanx.yamltext import Refused, safe_load

_EXAMPLES = "such as dataset.batch_size=64, +hooks=StopOnNaN or ~hooks.StopAfter"


def default_hooks(extra_streams: Sequence[str]) -> list[Any]:
    """The hooks of a config that lists none: progress, loss statistics, throughput, logs, metrics
    files, TensorBoard, the latest checkpoint, and the best one by validation loss when there is a
    `valid` stream."""
    hooks: list[Any] = [
        "ShowProgress",
        {"ComputeStats": {"variables": ["loss"]}},
        "LogThroughput",
        "LogVariables",
        "LogProfile",
        "WriteCSV",
        "WriteTensorBoard",
        "SaveLatest",
    ]
    if "valid" in extra_streams:
        hooks.append({"SaveBest": {"variable": "valid.loss", "mode": "min"}})
    return hooks


def apply(raw: dict, overrides: str | Sequence[str]) -> dict:
    """A copy of `raw` with `overrides` applied in order (one string is one override). Values are
    read as YAML."""
    if isinstance(overrides, str):
        overrides = [overrides]
    raw = copy.deepcopy(raw)
    for item in overrides:
        if not isinstance(item, str):
            raise ConfigError(
                f"override {item!r} is a {type(item).__name__}; give strings, {_EXAMPLES}"
            )
        _apply_one(raw, item)
    return raw


def _apply_one(raw: dict, item: str) -> None:
    op = item[0] if item[:1] in ("+", "~") else ""
    key, sep, text = item[len(op) :].partition("=")
    if op == "~":
        if sep or not key:
            raise ConfigError(f"override {item!r}: ~KEY deletes a key and takes no value")
    elif not sep or not key:
        raise ConfigError(f"override {item!r} is not KEY=VALUE; write one {_EXAMPLES}")
    parts = key.split(".")
    if any(not part for part in parts):
        raise ConfigError(f"override {item!r}: {key!r} has an empty part; write dotted keys")
    if parts[0] == "hooks" and raw.get("hooks") is None and len(parts) + (op == "+") > 1:
        main_loop = raw.get("main_loop")
        streams = main_loop.get("extra_streams") if isinstance(main_loop, dict) else None
        raw["hooks"] = default_hooks(streams if isinstance(streams, list) else [])
    parts = _by_index(raw, parts, item, whole_item=op == "~")
    if op == "~":
        _delete(raw, parts, item)
        return
    value = _value(text, item)
    if op == "+":
        _add(raw, parts, value, item)
    else:
        _set(raw, parts, value, item)


def _value(text: str, item: str) -> Any:
    try:
        return safe_load(text)
    except yaml.YAMLError:
        raise ConfigError(f"override {item!r}: the value is not valid YAML") from None
    except Refused as e:
        raise ConfigError(f"override {item!r}: the value is refused: {e}") from None


def name_of(entry: Any) -> str | None:
    """The name of a list item that is a name or a one-key mapping (a hook), else None."""
    if isinstance(entry, str):
        return entry
    if isinstance(entry, dict) and len(entry) == 1:
        name = next(iter(entry))
        return name if isinstance(name, str) else None
    return None


def _by_index(raw: dict, parts: list[str], item: str, whole_item: bool) -> list[str]:
    """`parts` with each list item named by its name rewritten as `<index>.<name>`; a named item
    that is a bare name becomes a one-key mapping, so that keys can be set inside it. With
    `whole_item`, a name that ends the path stands for the item itself (what `~` deletes)."""
    out: list[str] = []
    node: Any = raw
    for depth, part in enumerate(parts):
        last = depth == len(parts) - 1
        if isinstance(node, list) and not part.lstrip("-").isdigit():
            where = ".".join(parts[:depth])
            found = [i for i, entry in enumerate(node) if name_of(entry) == part]
            if not found:
                names = [n for n in map(name_of, node) if n is not None]
                raise ConfigError(
                    f"override {item!r}: {where} has no item {part!r}"
                    + (f" (it holds {', '.join(names)})" if names else "")
                    + f"; name an item by its index, 0 to {len(node) - 1}, or add one with "
                    f"+{where}=..."
                )
            if len(found) > 1:
                raise ConfigError(
                    f"override {item!r}: {where} holds {len(found)} items named {part!r} (at "
                    f"{', '.join(map(str, found))}); name one by its index, such as "
                    f"{where}.{found[0]}.{part}"
                )
            index = found[0]
            if last and whole_item:
                return [*out, str(index)]
            if isinstance(node[index], str):
                node[index] = {part: None}
            out += [str(index), part]
            node = node[index][part]
            continue
        out.append(part)
        following = parts[depth + 1] if not last else None
        if isinstance(node, list) and following is not None:  # hooks.3.StopAfter.epochs
            index = int(part)
            if -len(node) <= index < len(node) and node[index] == following:
                node[index] = {following: None}
        node = _child(node, part)
    return out


def _child(node: Any, part: str) -> Any:
    """What `part` names inside `node`, or None where it names nothing (yet)."""
    if isinstance(node, dict):
        return node.get(part)
    if (
        isinstance(node, list)
        and part.lstrip("-").isdigit()
        and -len(node) <= int(part) < len(node)
    ):
        return node[int(part)]
    return None


def _parent(raw: dict, parts: list[str], item: str, create: bool) -> tuple[Any, Any]:
    """The container that holds the last part of the path, and the key or index there. `create`
    makes missing mappings on the way."""
    node: Any = raw
    for depth, part in enumerate(parts):
        where = ".".join(parts[: depth + 1])
        if isinstance(node, list):
            if not part.lstrip("-").isdigit() or not -len(node) <= int(part) < len(node):
                raise ConfigError(
                    f"override {item!r}: {where!r} is not an index of a list of {len(node)} items"
                )
            key: Any = int(part)
        elif isinstance(node, dict):
            key = part
            if depth < len(parts) - 1 and node.get(part) is None:
                if not create:
                    raise ConfigError(f"override {item!r}: the config has no {where!r}")
                node[part] = {}
        else:
            raise ConfigError(
                f"override {item!r}: {'.'.join(parts[:depth])!r} is a {type(node).__name__}, "
                "not a section"
            )
        if depth == len(parts) - 1:
            return node, key
        node = node[key]
    raise AssertionError("unreachable: parts is never empty")


def _set(raw: dict, parts: list[str], value: Any, item: str) -> None:
    node, key = _parent(raw, parts, item, create=True)
    node[key] = value


def _add(raw: dict, parts: list[str], value: Any, item: str) -> None:
    """`+KEY=VALUE`: append to the list at KEY, or set a key that is not set yet."""
    node, key = _parent(raw, parts, item, create=True)
    current = node.get(key) if isinstance(node, dict) else node[key]
    if isinstance(current, list):
        current.append(value)
    elif current is None:
        node[key] = value
    else:
        path = ".".join(parts)
        raise ConfigError(
            f"override {item!r}: {path} is set already ({current!r}) and is not a list; "
            f"write {path}=VALUE to change it"
        )


def _delete(raw: dict, parts: list[str], item: str) -> None:
    """`~KEY`: remove a key of a mapping or an item of a list."""
    node, key = _parent(raw, parts, item, create=False)
    if isinstance(node, dict) and key not in node:
        raise ConfigError(f"override {item!r}: the config has no {'.'.join(parts)!r} to delete")
    del node[key]
