"""A class or function a config names, imported and called: `import_object` finds it by its dotted
path (in the search directories too), `instantiate` calls it with the config's keywords and turns
a keyword it refuses, or a number of the wrong kind, into a ConfigError naming the key,
`build_value` builds the `{class: ...}` mappings nested in those keywords.
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from phalanx.errors import ConfigError, beyond_input, did_you_mean, named

KERAS_INSTALL = 'pip install -e ".[keras]" (or pip install keras)'


def prefer_torch_keras() -> None:
    """Keras, if it is imported from here on, on its torch backend (where none was chosen): the
    one place phalanx chooses it (see `keras_models`)."""
    if "keras" not in sys.modules:
        os.environ.setdefault("KERAS_BACKEND", "torch")


def import_object(
    path: str,
    search_dirs: Sequence[Path] = (),
    default_module: str | None = None,
    key: str | None = None,
) -> Any:
    """The object a dotted path names; `default_module` is tried first for a bare name. `key`: the
    config key that gives the path, which an error names first."""
    try:
        return _import_object(path, search_dirs, default_module)
    except ConfigError as e:
        if key is None:
            raise
        raise ConfigError(f"{key}: {e}") from None


def _import_object(path: str, search_dirs: Sequence[Path], default_module: str | None) -> Any:
    for folder in [*search_dirs, Path.cwd()]:
        if str(folder) not in sys.path:
            sys.path.append(str(folder))
    if default_module and "." not in path:
        module = importlib.import_module(default_module)
        if hasattr(module, path):
            return getattr(module, path)
        raise ConfigError(
            f"{default_module} has no {path!r}{did_you_mean(path, dir(module))}; "
            f"give a name from {default_module} or a dotted path such as mypkg.MyClass"
        )
    module_name, _, attr = path.rpartition(".")
    # a user's module may import Keras: on torch, unless told otherwise
    prefer_torch_keras()
    if not module_name:
        raise ConfigError(
            f"class {path!r} is not a dotted path; write e.g. mypackage.module.MyClass"
        )
    for root in _package_roots(module_name, search_dirs):
        if str(root) not in sys.path:
            sys.path.append(str(root))
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        if (e.name or "").split(".")[0] == "keras":  # an optional dependency, named where used
            raise ConfigError(
                f"{path!r} needs Keras, which is not installed: {KERAS_INSTALL}"
            ) from None
        raise ConfigError(
            f"cannot import {module_name!r} for {path!r}: {e}; check the path, or run "
            f"from the folder that holds the package"
        ) from None
    if not hasattr(module, attr):
        raise ConfigError(
            f"module {module_name!r} has no {attr!r}{did_you_mean(attr, dir(module))}"
        )
    return getattr(module, attr)


def _package_roots(module_name: str, search_dirs: Sequence[Path]) -> list[Path]:
    """Folders that hold `module_name` when a search folder lies inside its package: a config in
    examples/digits/ naming examples.digits.data finds it from any working directory."""
    parts = module_name.split(".")
    roots = []
    for folder in search_dirs:
        folder = Path(folder).resolve()
        for k in range(1, min(len(parts), len(folder.parts))):
            if list(folder.parts[-k:]) == parts[:k]:
                root = folder.parents[k - 1]
                target = root.joinpath(*parts)
                if target.with_suffix(".py").is_file() or (target / "__init__.py").is_file():
                    roots.append(root)
    return roots


def instantiate(section: str, factory: Any, *args: Any, **kwargs: Any) -> Any:
    """Call a class with config arguments; a keyword it refuses is a ConfigError naming the ones it
    declares. Its signature is a hint, not the truth: a constructor may take more keywords than it
    declares (Hugging Face configs do), so the call decides which it takes. The hint still refuses,
    before the call, a boolean for a number and a fraction for an integer, which Python would
    take."""
    params = _parameters(factory)
    for key, value in kwargs.items():
        _check_number(section, factory, key, value, params.get(key))
    try:
        return factory(*args, **kwargs)
    except TypeError as e:
        refused = _refused_keyword(e, kwargs)
        if refused is not None:
            valid = [
                n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
            ]
            raise ConfigError(
                f"{section}: {_name(factory)} takes no argument {refused!r}"
                f"{did_you_mean(refused, valid)}; it takes {', '.join(valid) or 'none'}"
            ) from None
        missing = re.search(r"missing \d+ required (?:positional |keyword-only )?argument", str(e))
        if missing:
            needed = ", ".join(re.findall(r"'(\w+)'", str(e)[missing.start() :]))
            raise ConfigError(
                f"{section}: {_name(factory)} needs {needed}; set it in the {section} section"
            ) from None
        raise _describe_failure(section, factory, kwargs, e) from e
    except (ValueError, RuntimeError, OSError, LookupError) as e:
        # not a value of the config's (torch.OutOfMemoryError is a RuntimeError): said as it is
        if beyond_input(e):
            raise
        # the constructor rejected a value (torch's checks raise RuntimeError: a negative size), or
        # a file or key it names is not there: name the section (--debug: traceback)
        raise _describe_failure(section, factory, kwargs, e) from e
    except ImportError as e:  # a package the class imports when it is made
        raise ConfigError(
            f"{section}: {_name(factory)} failed: {named(e)}; install what it imports"
        ) from e


def _describe_failure(
    section: str, factory: Any, kwargs: dict[str, Any], error: Exception
) -> ConfigError:
    given = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
    return ConfigError(
        f"{section}: {_name(factory)}({given}) failed: {named(error)}; "
        f"fix the values in the {section} section"
    )


def _parameters(factory: Any) -> dict[str, inspect.Parameter]:
    """The parameters `factory` declares; none where it has no signature Python can read."""
    try:
        return dict(inspect.signature(factory).parameters)
    except (TypeError, ValueError):
        return {}


def _refused_keyword(error: TypeError, kwargs: dict[str, Any]) -> str | None:
    """The keyword that a call's TypeError says was not taken, if it is one of ours."""
    found = re.search(r"unexpected keyword argument '(\w+)'", str(error))
    return found.group(1) if found and found.group(1) in kwargs else None


def _check_number(
    section: str, factory: Any, key: str, value: Any, param: inspect.Parameter | None
) -> None:
    """A boolean or a string where the parameter is annotated as a number, or a fraction where it
    is annotated as an integer, is a ConfigError: Python would take any of them, and fail later
    or silently."""
    if param is None:
        return
    names = set(re.findall(r"[A-Za-z_]+", str(param.annotation)))
    if isinstance(value, bool) and _takes_numbers_not_bools(param):
        raise ConfigError(
            f"{section}: {_name(factory)}'s {key} takes a number, got {str(value).lower()}; "
            f"write a number for {key} in the {section} section"
        )
    if isinstance(value, float) and "int" in names and not names & _NOT_ONLY_INTEGERS:
        raise ConfigError(
            f"{section}: {_name(factory)}'s {key} takes an integer, got {value!r}; "
            f"write a whole number for {key} in the {section} section"
        )
    # a string where only a number is meant fails deep in the constructor, if at all
    if isinstance(value, str) and _takes_only_numbers(names):
        kind = "an integer" if "float" not in names else "a number"
        raise ConfigError(
            f"{section}: {_name(factory)}'s {key} takes {kind}, got the string {value!r}; "
            f"write {kind} (unquoted) for {key} in the {section} section"
        )
    # a string where a list is meant would be taken letter by letter
    if isinstance(value, str) and _takes_lists_not_strings(param):
        raise ConfigError(
            f"{section}: {_name(factory)}'s {key} takes a list, got the string {value!r}; "
            f"write [{value}] for {key} in the {section} section"
        )


# annotation names of a list of values
_LISTS = {"list", "List", "Sequence", "tuple", "Tuple", "Iterable", "Collection"}
# annotation names beside `int` under which a float may be meant
_NOT_ONLY_INTEGERS = {
    "float",
    "Any",
    "object",
    "Number",
    "Real",
    "complex",
    "Tensor",
    "SupportsFloat",
}


def _takes_only_numbers(names: set[str]) -> bool:
    """Whether an annotation's names are those of a number alone (or none: `int | None`); `int`
    itself reads `<class 'int'>`."""
    return bool(names & {"int", "float"}) and names <= _NUMBERS


_NUMBERS = {"int", "float", "None", "NoneType", "Optional", "typing", "class"}


def _takes_lists_not_strings(param: inspect.Parameter) -> bool:
    """Whether a parameter is annotated as a list (a sequence ...) and not as a string, at its top
    level: `list[str] | None` is, `str | list[str]` is not."""
    top = str(param.annotation)
    while "[" in top:  # what the brackets hold is the items'
        top = re.sub(r"\[[^\[\]]*\]", "", top)
    names = set(re.findall(r"[A-Za-z_]+", top))
    return bool(names & _LISTS) and not names & {"str", "Any", "object"}


def _takes_numbers_not_bools(param: inspect.Parameter) -> bool:
    """Whether a parameter is annotated as a number and not as a bool (a bool is an int to Python,
    so `steps: true` would quietly mean 1)."""
    names = set(re.findall(r"[A-Za-z_]+", str(param.annotation)))
    return bool(names & {"int", "float"}) and "bool" not in names


def build_value(value: Any, where: str, search_dirs: Sequence[Path]) -> Any:
    """Nested `{class: ..., ...}` mappings inside constructor arguments are built too."""
    if isinstance(value, dict) and "class" in value:
        kwargs = {
            k: build_value(v, f"{where}.{k}", search_dirs) for k, v in value.items() if k != "class"
        }
        args = kwargs.pop("args", [])
        factory = import_object(value["class"], search_dirs, key=f"{where}.class")
        return instantiate(where, factory, *args, **kwargs)
    if isinstance(value, list):
        return [build_value(v, f"{where}.{i}", search_dirs) for i, v in enumerate(value)]
    if isinstance(value, dict):
        return {k: build_value(v, f"{where}.{k}", search_dirs) for k, v in value.items()}
    return value


def _name(factory: Any) -> str:
    return getattr(factory, "__qualname__", repr(factory))
