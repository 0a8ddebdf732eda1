"""A strategy of one's own, written as README's "Writing a strategy" says: this one module, which
registers it as it is imported. `toy` trains as `single` does, on one device, and counts its
steps; its section `parallel.toy` has a key of its own, which reaches the strategy built."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from pydantic import Field, StrictInt

from phalanx.settings import StrategySettings
from phalanx.strategies.base import Micros, Outcome
from phalanx.strategies.registry import Family, register
from phalanx.strategies.single import Single

if TYPE_CHECKING:
    from phalanx.config import Config
    from phalanx.engine import Engine


class ToySettings(StrategySettings):
    """`parallel.toy`."""

    tag: str = Field("untagged", description="a word the strategy keeps")
    every: StrictInt = Field(1, ge=1, description="steps between the strategy's counts")


class Toy(Single):
    def __init__(self, device: torch.device, settings: ToySettings):
        super().__init__(device)
        self.settings = settings
        self.steps = self.counted = 0

    def train_step(self, engine: Engine, micros: Micros, stop: bool) -> Outcome:
        self.steps += 1
        if self.steps % self.settings.every == 0:
            self.counted += 1
        return super().train_step(engine, micros, stop)


BUILT: list[Toy] = []  # what the builder built, for the test to look at


def build(cfg: Config, accelerator: str, devices: int) -> Toy:
    BUILT.append(Toy(torch.device(accelerator), cfg.parallel.section("toy", ToySettings)))
    return BUILT[-1]


register(
    Family(
        "toy",
        build,
        "one device, as single, counting its steps",
        settings=ToySettings,
        field=Field(default_factory=ToySettings, description="the toy strategy's"),
    )
)
