"""The strategies as the config names them: each strategy's module declares itself once, with
`register(Family(...))`, and the rest of phalanx asks the registry (`families`, `get`), never a
strategy by name.

A family says how to build its strategy for this process (with its checks), whether it runs one
process per device, its summary, its own section of `parallel` (the settings class the config's
schema validates `parallel.<name>` with), and, where `phalanx plan` prices it, its setups and
their cost.

The built-in strategies' modules are imported on the first question to the registry (`BUILTIN`),
not when this module is: the config's schema asks for the sections as it validates a config, and
the strategies' modules read the config's types, so neither imports the other while it loads. A
strategy of one's own is a module that calls `register` when it is imported: import it before
the config is loaded.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from phalanx.errors import ConfigError

if TYPE_CHECKING:
    from phalanx.config import Config
    from phalanx.costs import Measured, Prediction, Setup
    from phalanx.strategies.base import Strategy

# the modules of phalanx's own strategies, in the order the config's choices list them
BUILTIN = (
    "single",
    "ddp",
    "towers",
    "fsdp",
    "mesh",
    "pipeline",
    "placement",
    "param_server",
)


def _no_check(cfg: Config, accelerator: str, processes: int) -> None:
    """A strategy whose config has no conditions beyond its settings' own."""


def _none(cfg: Config) -> int:
    return 0


def _no_rejoin(cfg: Config, devices: int) -> tuple[int, ...]:
    return ()


def _nothing_ignored(cfg: Config, running: str) -> list[str]:
    return []


@dataclass(frozen=True)
class Family:
    """A strategy as the config names it (`parallel.strategy: <name>`)."""

    name: str
    # (config, accelerator, devices per machine) -> the strategy of this process, its config
    # checked
    build: Callable[[Config, str, int], Strategy]
    summary: str  # what it does, in a line
    # whether `phalanx train` starts one process per device for it, or it drives all of them from
    # one
    process_per_device: bool = False
    # the conditions of the config alone on the processes of the job, which `build` checks too,
    # and `phalanx train` and `resume` before any process starts or anything is written:
    # (config, accelerator, processes)
    check: Callable[[Config, str, int], None] = _no_check
    # its section `parallel.<name>`: the type pydantic validates it with and pydantic's Field
    # (its default and description); None: no section
    settings: Any = None
    field: Any = None
    # what `parallel.strategy: auto` picks: "one" on one device, "several" on several
    auto: str | None = None
    # suggested where a job needs one process per device on several machines
    general: bool = False
    # shards the model's state over the devices: suggested for a model too large for one
    shards_state: bool = False
    # processes of a run that hold no device (a parameter server's servers)
    host_processes: Callable[[Config], int] = _none
    # the ranks whose worker, where it dies, is started again alone while the others go on
    rejoining: Callable[[Config, int], tuple[int, ...]] = _no_rejoin
    # warnings about what the config sets for this strategy that a run of another, `running`,
    # ignores
    ignored: Callable[[Config, str], list[str]] = _nothing_ignored
    # parallel.build=device: whether it keeps the whole model on one device (and may build it
    # there), and otherwise how it builds a large model instead
    builds_on_device: bool = True
    large_model: str = "parallel.build=host"
    # `phalanx plan`: the setups it prices up to `devices` devices, and each one's prediction;
    # None: the planner does not price it
    setups: Callable[[Measured, int], list[Setup]] | None = None
    cost: Callable[[Measured, Setup], Prediction] | None = None
    # why the plan has no row of it (None: it has), from the measurements and the devices
    unplanned: Callable[[Measured, int], str | None] | None = None
    # lines the plan prints under its table about this strategy, from the measurements and every
    # ranked prediction (where its setups would pay on another link, say)
    notes: Callable[[Measured, list[Prediction]], list[str]] | None = None
    # a setup's label in the plan's table, and the processes that each fetch their samples
    label: Callable[[Setup], str] | None = None
    readers: Callable[[Setup], int] | None = None
    # parallel.gradient_accumulation=auto: (config, devices) -> the setup to price from the
    # measurements; it refuses, before anything is measured, a config it cannot price
    accumulation_setup: Callable[[Config, int], Callable[[Measured], Setup]] | None = None
    # parallel.strategy=plan: the `parallel` settings beyond strategy and devices of a plan's row
    # (`plan.json`'s), or None where a config cannot name the row's setup
    plan_settings: Callable[[dict[str, Any]], dict[str, Any] | None] = lambda row: {}


_FAMILIES: dict[str, Family] = {}
_loaded = False


def register(family: Family) -> Family:
    """Add `family` (a strategy's module calls it as it is imported); configs validated from now
    on know its name and its section."""
    _FAMILIES[family.name] = family
    return family


def families() -> dict[str, Family]:
    """Every registered strategy by name, phalanx's own first."""
    global _loaded
    if not _loaded:
        for module in BUILTIN:
            importlib.import_module(f"phalanx.strategies.{module}")
        _loaded = True  # after every import: one that failed is tried again, not left out
        # a strategy of one's own imported before the first question comes after phalanx's own
        ordered = {name: _FAMILIES[name] for name in BUILTIN if name in _FAMILIES}
        rest = {name: f for name, f in _FAMILIES.items() if name not in ordered}
        _FAMILIES.clear()
        _FAMILIES.update({**ordered, **rest})
    return _FAMILIES


def get(name: str) -> Family:
    """The strategy `name`; a KeyError where none registered it (see `strategies.strategy_name`
    for the config's error)."""
    return families()[name]


def auto(several: bool) -> str:
    """What `parallel.strategy: auto` picks for one device or several."""
    return next(n for n, f in families().items() if f.auto == ("several" if several else "one"))


def sections() -> dict[str, tuple[Any, Any]]:
    """Each strategy's section of `parallel`: name -> (its type, pydantic's Field)."""
    return {n: (f.settings, f.field) for n, f in families().items() if f.settings is not None}


PRECISION = "precision=fp16"  # the setting `refuse` names where a strategy cannot train in fp16


def refuse(name: str, unsupported: dict[str, bool], instead: str) -> None:
    """One error naming the settings strategy `name` does not support that the config uses; where
    fp16 is one, the hint of bf16 with it."""
    named = [setting for setting, used in unsupported.items() if used]
    if named:
        if PRECISION in named:
            instead += " (bf16 instead of fp16)"
        raise ConfigError(
            f"parallel.strategy={name} does not support {', '.join(named)}; remove it, or use "
            f"{instead}"
        )
