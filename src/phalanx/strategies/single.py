"""`single`: one process, one device."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from phalanx.strategies.base import Micros, ModelOptions, OneProcess, Replicated, prepare

if TYPE_CHECKING:
    from phalanx.engine import Engine


class Single(OneProcess, Replicated):
    def __init__(self, device: torch.device):
        self.device = device
        self.devices = (device,)

    def setup(self, module: nn.Module, options: ModelOptions) -> tuple[nn.Module, nn.Module]:
        self.model = module  # preparing it keeps the same object: its methods change it in place
        return prepare(module, options, lambda m: m.to(self.device)), self.model

    def forward_backward(
        self, engine: Engine, micros: Micros, stop: bool
    ) -> tuple[list[dict | None], torch.Tensor, bool, float]:
        total: torch.Tensor | None = None
        parts: list[dict | None] = []
        for micro, batch in micros:
            assert batch is not None  # one process: no shard is ever empty
            loss, gradient, part, data = engine.forward(micro, batch, 1.0)
            engine.backward(loss, gradient)
            total = part if total is None else total + part
            parts.append(data)
        assert total is not None  # a step has one micro-batch or more
        return parts, total, stop, 0.0

    def shutdown(self) -> None:
        pass
