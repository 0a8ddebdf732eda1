"""`single`: one process, one device."""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

import torch
from torch import nn

from phalanx.costs import Measured, Prediction, Setup, made, ms, whole_bytes
from phalanx.errors import ConfigError
from phalanx.strategies import in_worker
from phalanx.strategies.base import (
    DataParallel,
    Micros,
    ModelOptions,
    OneProcess,
    Outcome,
    Replicated,
    prepare,
)
from phalanx.strategies.registry import Family, register

if TYPE_CHECKING:
    from phalanx.config import Config
    from phalanx.engine import Engine


class Single(OneProcess, Replicated, DataParallel):
    def __init__(self, device: torch.device):
        self.device = device
        self.devices = (device,)

    def setup(self, module: nn.Module, options: ModelOptions) -> tuple[nn.Module, nn.Module]:
        self.model = module  # preparing it keeps the same object: its methods change it in place
        return prepare(module, options, lambda m: m.to(self.device)), self.model

    def train_step(self, engine: Engine, micros: Micros, stop: bool) -> Outcome:
        """`DataParallel.train_step` with nothing to agree on and no process to carry anything to:
        the micro-batches' forwards and backwards in one loop, without the protocol's calls
        around each (on a small model each layer of Python costs the step several times its own
        time: BENCHMARKS.md, the step layer by layer)."""
        engine.begin()
        forward, backward, replica = engine.forward, engine.backward, self.replica
        parts: list[dict | None] = []
        total: torch.Tensor | None = None
        for micro, batch in micros:
            if batch is None:
                parts.append(None)
                continue
            loss, gradient, part, data = forward(micro, batch, replica)
            total = part if total is None else total + part
            backward(loss, gradient)
            parts.append(data if micro.shard else None)
        assert total is not None  # one process: a step has one micro-batch or more
        start = time.perf_counter()
        loss = engine.finish(total, self.gradient_norm)
        return Outcome(loss, parts, stop, 0.0, time.perf_counter() - start)

    def shutdown(self) -> None:
        pass


def build(cfg: Config, accelerator: str, devices: int) -> Single:
    if in_worker() or devices > 1:
        raise ConfigError(
            f"parallel.strategy=single runs one process on one device, but {devices} devices "
            "were asked for; set parallel.strategy=auto (or ddp), or parallel.devices=1"
        )
    return Single(torch.device(accelerator))


def price(m: Measured, setup: Setup) -> Prediction:
    """One device computes every micro-batch of the step in turn."""
    micro = math.ceil(m.batch / m.accumulation)
    compute = m.accumulation * m.compute.time(micro)
    memory = whole_bytes(m) + m.activation_bytes_per_sample * micro
    return made(
        m,
        setup,
        {"compute": compute, "optimizer": m.optimizer_s},
        memory,
        f"one device computes the batch of {m.batch} in {ms(compute)}",
    )


register(
    Family(
        "single",
        build,
        "one process, one device",
        auto="one",
        setups=lambda m, devices: [Setup("single", 1)],
        cost=price,
    )
)
