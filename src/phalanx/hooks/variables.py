"""Reading `stream.variable` names out of an epoch's shared dict."""

from __future__ import annotations

from typing import Any

from phalanx.data import TRAIN
from phalanx.errors import ConfigError


def split_name(name: str, hook: str) -> tuple[str, str]:
    stream, sep, var = name.partition(".")
    if not sep or not stream or not var:
        raise ConfigError(f"{hook}: variable {name!r} must be STREAM.VARIABLE, e.g. valid.loss")
    return stream, var


def check_evaluated(name: str, hook: str, extra_streams: list[str]) -> None:
    """`name`'s stream is one the run evaluates (the training stream or one of `extra_streams`):
    checked before training, not after its first epoch."""
    stream, _ = split_name(name, hook)
    streams = [TRAIN, *extra_streams]
    if stream not in streams:
        raise ConfigError(
            f"{hook}: stream {stream!r} of {name} is not evaluated (streams: "
            f"{', '.join(streams)}); add it to main_loop.extra_streams, or name another"
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
