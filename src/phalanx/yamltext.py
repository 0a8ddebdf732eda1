"""YAML as phalanx reads it: `safe_load` only, YAML 1.2 floats, no key twice in one mapping, and
bounds on what a text may expand to.

YAML's aliases let a 1 KB file stand for billions of values (each `*a` repeats a whole subtree),
which the parser builds cheaply, as shared objects, and everything after it (validation, the
resolved `config.yaml`) would expand. So every value read is measured first, counting each
subtree as often as it is referred to, and a config that would expand past `MAX_VALUES` values or
`MAX_DEPTH` levels is refused in one line.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from phalanx.errors import ConfigError, PhalanxError

MAX_VALUES = 200_000  # values (mappings, lists and scalars) once aliases are expanded
MAX_DEPTH = 64  # levels of nested mappings and lists


class Refused(ValueError):
    """YAML that phalanx does not take: a key twice in one mapping, or a value past the bounds."""


class DuplicateKey(Refused):
    """A mapping that gives one key twice (YAML's loaders keep the last, silently)."""


class _Loader(yaml.SafeLoader):
    """YAML's safe loader, reading `1e-3` as a float as every other YAML 1.2 reader does, and
    refusing a key given twice in one mapping (a merge's keys, `<<: *base`, may be given again:
    that is what a merge is for)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        if isinstance(node, yaml.MappingNode):
            self._check_unique(node)
        return super().construct_mapping(node, deep=deep)

    def _check_unique(self, node: yaml.MappingNode) -> None:
        lines: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key, line = self.construct_object(key_node, deep=True), key_node.start_mark.line + 1
            try:
                first = lines.get(key)
            except TypeError:  # not hashable: the loader says so itself
                continue
            if first is not None:
                raise DuplicateKey(
                    f"the key {key!r} is given twice in one mapping, on lines {first} and "
                    f"{line}; keep one of them"
                )
            lines[key] = line


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"^[-+]?(?:[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?|\.[0-9_]+(?:[eE][-+]?[0-9]+)?"
        r"|[0-9][0-9_]*[eE][-+]?[0-9]+|\.inf|\.Inf|\.INF|\.nan|\.NaN|\.NAN)$"
    ),
    list("-+0123456789."),
)


_TOO_DEEP = f"it is nested more than {MAX_DEPTH} levels deep; a config needs far fewer: check it"


class TooLarge(Refused):
    """A value past the bounds: too many values once aliases are expanded, too deep, or cyclic."""


def safe_load(text: str) -> Any:
    """YAML text as plain Python values; never constructs arbitrary objects. Raises DuplicateKey
    for a key given twice in one mapping, TooLarge past the bounds, and yaml.YAMLError for text
    that is not YAML."""
    try:
        value = yaml.load(text, Loader=_Loader)  # safe: _Loader is a SafeLoader subclass
    except RecursionError:  # the parser recurses once per level
        raise TooLarge(_TOO_DEEP) from None
    check_bounds(value)
    return value


def check_bounds(value: Any) -> None:
    """Raise TooLarge where `value` expands to more than MAX_VALUES values, nests deeper than
    MAX_DEPTH levels, or holds itself. Linear in the distinct objects, however often each is
    shared."""
    _measure(value, {}, 0)


def _measure(value: Any, seen: dict[int, tuple[int, int] | None], depth: int) -> tuple[int, int]:
    """(values, height) of `value`, each shared subtree measured once and counted every time."""
    if not isinstance(value, (dict, list)):
        return 1, 0
    if depth > MAX_DEPTH:
        raise TooLarge(_TOO_DEEP)
    known = seen.get(id(value), ())
    if known is None:
        raise TooLarge(
            "it holds itself (an alias inside the mapping or list it names); remove the alias"
        )
    if known:
        values, height = known
        if depth + height > MAX_DEPTH:
            raise TooLarge(_TOO_DEEP)
        return values, height
    seen[id(value)] = None  # being measured: meeting it again inside itself is a cycle
    total, height = 1, 0
    for child in value.values() if isinstance(value, dict) else value:
        values, below = _measure(child, seen, depth + 1)
        total, height = total + values, max(height, below + 1)
        if total > MAX_VALUES:
            raise TooLarge(
                f"it expands to more than {MAX_VALUES:,} values once its aliases (*name) are "
                "expanded; write the values out, or refer to fewer"
            )
    seen[id(value)] = (total, height)
    return total, height


def read_yaml(path: Path, fix: str, error: type[PhalanxError] = ConfigError) -> Any:
    """What a YAML file holds; an `error` naming the file and `fix` when it is unreadable, not UTF-8
    (a Latin-1 or binary file), not YAML, or past the bounds."""
    try:
        text = path.read_bytes().decode("utf-8-sig")
    except OSError as e:
        raise error(f"cannot read {path}: {e.strerror or e}; {fix}") from None
    except UnicodeDecodeError as e:
        raise error(
            f"{path} is not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start}); {fix}"
        ) from None
    try:
        return safe_load(text)
    except yaml.YAMLError as e:
        raise error(f"{path} is not valid YAML{_problem(e)}; {fix}") from None
    except Refused as e:
        raise error(f"{path} is refused: {e}") from None


def _problem(error: yaml.YAMLError) -> str:
    """Where and what a YAML parser's error is: ' at line L, column C: expected ... (while ...)'
    for one that marks its place; the first line of its text for any other."""
    mark, problem = getattr(error, "problem_mark", None), getattr(error, "problem", None)
    if mark is None or not problem:
        return f": {str(error).splitlines()[0]}"
    context = getattr(error, "context", None)
    return f" at line {mark.line + 1}, column {mark.column + 1}: {problem}" + (
        f" ({context})" if context else ""
    )
