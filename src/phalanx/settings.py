"""What every strategy's own section of `parallel` (`parallel.<strategy>`) is.

A strategy's section is named after it and checked as every section of the config is: its keys'
types and ranges, and an unknown key is a did-you-mean error. Each strategy's module declares its
class (a `StrategySettings`) in its `registry.Family`; the config builds its schema from the
registry, and the strategies read theirs with `cfg.parallel.section(name, Settings)`.
"""

from __future__ import annotations

import importlib
from typing import Any

from pydantic import BaseModel, ConfigDict

# the strategies' registry, loaded by name where a config is first validated: the registry loads
# the strategies' modules, which read the config's types, so the config cannot import it as it
# loads
REGISTRY = "phalanx.strategies.registry"


class StrategySettings(BaseModel):
    """A strategy's own section of `parallel`."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


def sections() -> dict[str, tuple[Any, Any]]:
    """Each registered strategy's section of `parallel`: name -> (its type, pydantic's Field)."""
    return importlib.import_module(REGISTRY).sections()
