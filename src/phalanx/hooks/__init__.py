"""Built-in hooks, found by name in a config's `hooks:` list; others are given by dotted path."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from phalanx import overrides
from phalanx.config import Config
from phalanx.construct import import_object, instantiate
from phalanx.errors import ConfigError, did_you_mean
from phalanx.hooks.base import Hook, TrainingTerminated
from phalanx.hooks.progress import ShowProgress
from phalanx.hooks.saving import SaveBest, SaveEvery, SaveLatest
from phalanx.hooks.stats import ClassificationMetrics, ComputeStats
from phalanx.hooks.stopping import StopAfter, StopOnNaN, StopOnPlateau
from phalanx.hooks.throughput import LogThroughput
from phalanx.hooks.trackers import WriteMLflow, WriteWandb
from phalanx.hooks.writers import LogProfile, LogVariables, PlotLines, WriteCSV, WriteTensorBoard

BUILTIN: dict[str, type[Hook]] = {
    cls.__name__: cls
    for cls in (
        ShowProgress,
        ComputeStats,
        ClassificationMetrics,
        LogVariables,
        LogProfile,
        WriteCSV,
        WriteTensorBoard,
        PlotLines,
        WriteMLflow,
        WriteWandb,
        LogThroughput,
        SaveEvery,
        SaveBest,
        SaveLatest,
        StopAfter,
        StopOnNaN,
        StopOnPlateau,
    )
}

__all__ = ["BUILTIN", "Hook", "TrainingTerminated", "build_hooks", "default_hooks", *BUILTIN]


def default_hooks(cfg: Config) -> list[Any]:
    """The hooks of a config that lists none (see `phalanx.overrides.default_hooks`)."""
    return overrides.default_hooks(cfg.main_loop.extra_streams)


def build_hooks(cfg: Config, search_dirs: list[Path]) -> list[Hook]:
    specs = cfg.hooks if cfg.hooks is not None else default_hooks(cfg)
    return [_build(i, spec, search_dirs) for i, spec in enumerate(specs)]


def _build(index: int, spec: Any, search_dirs: list[Path]) -> Hook:
    name, kwargs = (spec, {}) if isinstance(spec, str) else next(iter(spec.items()))
    kwargs = kwargs or {}
    if name in BUILTIN:
        factory = BUILTIN[name]
    elif "." in name:
        factory = import_object(name, search_dirs, key=f"hooks.{index}")
    else:
        raise ConfigError(
            f"hooks.{index}: no built-in hook {name!r}{did_you_mean(name, BUILTIN)}; "
            f"built-ins are {', '.join(BUILTIN)}, others are given by dotted path"
        )
    hook = instantiate(f"hooks.{index}.{name}", factory, **kwargs)
    if not isinstance(hook, Hook):
        raise ConfigError(f"hooks.{index}: {name} is not a phalanx.hooks.Hook subclass")
    return hook
