"""What every strategy's own section of `parallel` (`parallel.<strategy>`) is.

A strategy's section is named after it and checked as every section of the config is: its keys'
types and ranges, and an unknown key is a did-you-mean error. Each strategy's module declares its
class (a `StrategySettings`) in its `registry.Family`; the config builds its schema from the
registry, and the strategies read theirs with `cfg.parallel.section(name, Settings)`.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class StrategySettings(BaseModel):
    """A strategy's own section of `parallel`."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
