"""Reading `stream.variable` names out of an epoch's shared dict."""

from __future__ import annotations

import numbers
from typing import TYPE_CHECKING, Any

from phalanx.data import TRAIN
from phalanx.errors import ConfigError, did_you_mean

if TYPE_CHECKING:
    from phalanx.hooks.base import Hook


def split_name(name: str, hook: str) -> tuple[str, str]:
    stream, sep, var = name.partition(".")
    if not sep or not stream or not var:
        raise ConfigError(f"{hook}: variable {name!r} must be STREAM.VARIABLE, e.g. valid.loss")
    return stream, var


def check_computed(name: str, hook_name: str, hook: Hook) -> None:
    """`name` (STREAM.VARIABLE) is in the epoch's data when `hook` reads it: its stream is one the
    run evaluates (the training stream or one of main_loop.extra_streams) and the run or a hook
    listed before it computes the variable. Checked before training, not after the first epoch;
    where a hook listed before it cannot say what it computes (`Hook.computes`), it may put
    anything there, and nothing is checked."""
    stream, var = split_name(name, hook_name)
    known = hook.trainer.computed_before(hook, stream)
    if known is None:
        return
    streams = [TRAIN, *hook.trainer.cfg.main_loop.extra_streams]
    if stream not in streams:
        raise ConfigError(
            f"{hook_name}: stream {stream!r} of {name} is not evaluated (streams: "
            f"{', '.join(streams)}); add it to main_loop.extra_streams, or name another"
        )
    if var not in known:
        close = did_you_mean(name, [f"{stream}.{v}" for v in known])
        raise ConfigError(
            f"{hook_name}: no hook listed before it computes {name!r}; the {stream} stream's "
            f"variables will be {', '.join(sorted(known)) or 'none'}{close}. Name one of those, "
            f"or list ComputeStats or ClassificationMetrics computing it before {hook_name} in "
            "hooks"
        )


def lookup(epoch_data: dict[str, dict[str, Any]], name: str, hook: str) -> float:
    """The value of `stream.variable`; a clear error when no earlier hook computed it."""
    stream, var = split_name(name, hook)
    values = epoch_data.get(stream)
    if values is None:
        raise ConfigError(
            f"{hook}: stream {stream!r} is not evaluated (streams: {', '.join(epoch_data)}); "
            "add it to main_loop.extra_streams"
        )
    if var not in values:
        raise ConfigError(
            f"{hook}: {name!r} was not computed (the {stream} stream has "
            f"{', '.join(values) or 'nothing'}); list ComputeStats or ClassificationMetrics "
            f"before {hook} in hooks"
        )
    return float(values[var])


def improved(value: float, best: float | None, mode: str, min_delta: float = 0.0) -> bool:
    if best is None:
        return value == value  # a NaN never improves
    return value < best - min_delta if mode == "min" else value > best + min_delta


def saved(state: Any, key: str, hook: str, kinds: tuple[type, ...]) -> Any:
    """`state[key]` of a hook's saved state, if it is None or of one of `kinds` (bool is no number);
    else ValueError, which a resume takes for a damaged checkpoint."""
    value = state[key]
    if value is not None and (type(value) not in kinds):
        kind = " or ".join(k.__name__ for k in kinds)
        raise ValueError(f"{hook}'s saved {key} is {value!r:.60}, not {kind}")
    return value


def check_positive(hook: str, least: float = 0.0, zero: bool = False, **values: Any) -> None:
    """Each of `values` is None or a number above `least` (0: positive; with `zero`, 0 too; a
    bool is no number)."""
    for key, value in values.items():
        if value is None:
            continue
        number = isinstance(value, numbers.Real) and not isinstance(value, bool)
        if not number or not (value > least or (zero and value == 0)):
            if least:
                wanted = f"a number above {least:g}"
            else:
                wanted = "a number of 0 or more" if zero else "a positive number"
            raise ConfigError(f"{hook}: {key} must be {wanted}, got {value!r}")


def check_mode(mode: str, hook: str) -> str:
    if mode not in ("min", "max"):
        raise ConfigError(f"{hook}: mode {mode!r} must be min or max")
    return mode


def flat_variables(
    epoch_data: dict[str, dict[str, Any]], variables: list[str] | None = None
) -> dict[str, float]:
    """`{stream: {var: value}}` as `{"stream.var": value}`, numbers only, optionally filtered."""
    flat = {}
    for stream, values in epoch_data.items():
        for var, value in values.items():
            name = f"{stream}.{var}"
            if isinstance(value, (int, float)) and (
                variables is None or var in variables or name in variables
            ):
                flat[name] = float(value)
    return flat
